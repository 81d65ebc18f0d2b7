"""llama.cpp through llama-cpp-python's low-level API: the backend (``backend``), models
(``model``), contexts with their sequences (``context``), attention capture
(``capture``), model files and scorer cuts.  Import the submodules: this package
itself loads no native library (the unit tests import ``model_files`` without one)."""
