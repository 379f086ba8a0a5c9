"""tiny-lm: a small generative model (a character-level Llama-architecture causal LM) trained on generated tasks.

What ``fleet package`` needs to build a Bento of this family: the service's import path
and the files the Bento carries (training code stays out of it). ``data.py``,
``tokenizer.py``, ``config.py``, ``answers.py`` and ``train.py`` make a version; the service,
the engines (``engine.py`` over ``scheduler.py``; ``vllm_engine.py`` with ``vllm_args.py``)
and ``engine_choice.py`` serve it, and import each other flat, as files at the Bento's root.
"""

SERVICE = "service:TextGenerator"
BENTO_FILES = ("service.py", "engine.py", "scheduler.py", "engine_choice.py", "vllm_args.py", "vllm_engine.py")
# installed in the Bento beside torch and numpy, at the versions this environment runs
PACKAGES = ("transformers", "tokenizers", "safetensors", "torchao")
# Installed in the Bento only when the model's policy asks for a GPU (resources.gpu > 0): vLLM's
# engine, which the service takes on CUDA (vllm_engine.py). Its wheel is CUDA-only, so it is
# never in the project's lock and is pinned here, not read from this environment. 0.33.0 pins
# torch==2.13.0, the release the project runs (its requires_dist on PyPI, checked 2026-12-02).
GPU_PACKAGES = ("vllm==0.33.0",)
