"""The depth eval's tool results and answer checks (evals/agent_files.py), without a model:
every answer is really in its tool result, where the question says, and the checks accept a
copied answer and refuse a near miss."""

from __future__ import annotations

import json
import re

from evals.agent_files import Question, correct, tool_results


def test_every_answer_is_in_its_tool_result_where_the_question_says():
    results = tool_results(seed=11, n=10)
    assert {r.tool for r in results} >= {"Read", "Bash"}
    assert tool_results(11, 10) == results  # one seed, one set of tasks
    assert tool_results(12, 10) != results
    for r in results:
        for q in r.questions:
            if q.kind == "function_source":  # the source, line by line, behind the cat -n numbers
                plain = "\n".join(line.split("\t", 1)[1] for line in r.content.splitlines())
                assert q.answer in plain and q.answer.startswith("def ")
            elif q.kind == "definition_line":
                name = re.search(r"`(\w+)`", q.ask).group(1)
                if r.tool == "Read":
                    line = r.content.splitlines()[int(q.answer) - 1]
                    assert line.split("\t")[0].strip() == q.answer and f"def {name}(" in line
                else:
                    assert any(x.split(":")[1] == q.answer and f"def {name}(" in x for x in r.content.splitlines())
            elif q.kind == "json_value":
                section, entry, key = re.search(r"`([\w.]+)`", q.ask).group(1).split(".")
                assert str(json.loads(r.content)[section][entry][key]) == q.answer
            else:
                assert q.answer in r.content


def test_the_checks_accept_a_copy_and_refuse_a_near_miss():
    source = Question("function_source", "", "def f(a):\n    return a + 1")
    assert correct(source, "Here it is:\n```python\ndef f(a):   \n    return a + 1\n```")
    assert not correct(source, "def f(a):\n    return a + 2")
    line = Question("definition_line", "Quote where `foo` is defined.", "214")
    assert correct(line, "   214\tdef foo(a, b):") and correct(line, "src/x.py:214:def foo(a):")
    assert not correct(line, "   213\tdef foo(a, b):") and not correct(line, "214: def bar(a):")
    assert not correct(line, "2140\tdef foo(a):")
    number = Question("definition_line", "On which line is `foo` defined? Answer with the line number only.", "214")
    assert correct(number, "214") and correct(number, "Line 214.")
    assert not correct(number, "213") and not correct(number, "2140") and not correct(number, "214: def bar(a):")
    value = Question("constant_value", "", '"sealed-ledger"')
    assert correct(value, "The value is `sealed-ledger`.") and not correct(value, "sealed ledger")
