"""tiny-lm: a small generative model (a character-level Llama-architecture causal LM) trained on generated tasks.

What ``fleet package`` needs to build a Bento of this family: the service's import path
and the files the Bento carries (training code stays out of it). ``data.py``,
``tokenizer.py`` and ``train.py`` make a version; the engine, scheduler and service serve it.
"""

SERVICE = "service:TextGenerator"
BENTO_FILES = ("service.py", "engine.py", "scheduler.py")
# installed in the Bento beside torch and numpy, at the versions this environment runs
PACKAGES = ("transformers", "tokenizers", "safetensors", "torchao")
