"""The model files SpecGate knows (``model_files``), the cut scoring models made from them
(``scorer_cuts``) and the prefill settings measured for them here (``prefill_settings``)."""
