"""The tiny-lm family's training side: tokenizer, generated data, deterministic training, registration."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from bentos.tiny_lm import data
from bentos.tiny_lm.answers import evaluate, generate
from bentos.tiny_lm.config import PRESETS, TrainConfig
from bentos.tiny_lm.tokenizer import BOS, EOS, PAD, UNK, train_tokenizer
from bentos.tiny_lm.train import (
    collate,
    encode,
    generated_training_set,
    lr_factor,
    train,
    train_and_register,
)
from fleet.catalog.registry import Registry
from fleet.store import open_store
from tests.quiet import assert_quiet

TEST = PRESETS["test"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tiny-lm") / "artifact"
    lines: list[str] = []
    meta = train(TEST, out, log=lines.append)
    return out, meta, lines


# -- tokenizer -------------------------------------------------------------------------
def test_the_tokenizer_is_one_token_a_character_and_decodes_to_the_exact_text(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = train_tokenizer(data.corpus())
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == [PAD, BOS, EOS, UNK]
    for text in ("reverse abcdef>fedcba", "  two  spaces  ", "sort zyx>xyz", ""):
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1  # <s>, then one token a character
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids) == BOS + text
    assert tok("A?")["input_ids"][1:] == [tok.unk_token_id] * 2  # characters the corpus never had

    tok.save_pretrained(tmp_path / "tok")
    again = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "reverse ab cd>dc ba"
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.decode(again(text)["input_ids"], skip_special_tokens=True) == text
    assert (again.pad_token, again.bos_token, again.eos_token, again.unk_token) == (PAD, BOS, EOS, UNK)
    again.padding_side = "left"
    batch = again(["ab", "abcd"], padding=True)["input_ids"]
    assert batch[0][:2] == [again.pad_token_id] * 2 and batch[0][2] == again.bos_token_id


def test_token_ids_do_not_depend_on_the_order_of_the_corpus() -> None:
    corpus = data.corpus()
    assert train_tokenizer(corpus).get_vocab() == train_tokenizer(reversed(corpus)).get_vocab()
    with pytest.raises(ValueError, match="no text"):
        train_tokenizer([])


# -- data ------------------------------------------------------------------------------
def test_generated_examples_are_seeded_correct_and_never_shared_by_train_and_holdout() -> None:
    first = data.examples(300, seed=7)
    assert first == data.examples(300, seed=7) and data.digest(first) == data.digest(data.examples(300, seed=7))
    assert first != data.examples(300, seed=8) and data.digest(first) != data.digest(data.examples(300, seed=8))
    for prompt, answer in first:
        word = re.fullmatch(r"reverse ([a-z]{3,8})>", prompt).group(1)
        assert answer == word[::-1]
    train_prompts = {p for p, _ in data.examples(5000, seed=1)}
    holdout = data.examples(500, seed=1, split="holdout")
    assert len({p for p, _ in holdout}) == 500  # distinct
    assert not train_prompts & {p for p, _ in holdout}
    assert not train_prompts & {p for p, _ in data.examples(500, seed=2, split="holdout")}  # whatever the seeds
    short = data.examples(100, seed=1, letters=(3, 4))
    assert {len(a) for _, a in short} == {3, 4}
    both = data.examples(10, seed=1, tasks=("reverse", "sort"))
    assert [p.split()[0] for p, _ in both[:2]] == ["reverse", "sort"] and both[1][1] == "".join(sorted(both[1][1]))
    with pytest.raises(ValueError, match="unknown task"):
        data.examples(1, seed=1, tasks=("rot13",))
    with pytest.raises(ValueError, match="too few exist"):
        data.examples(10_000, seed=1, split="holdout", letters=(3, 3))


def test_exact_match_counts_whole_answers_only() -> None:
    assert data.exact_match(["cba", "fed", "x"], ["cba", "fe", "x "]) == pytest.approx(1 / 3)
    assert data.exact_match(["cba"], ["cba"]) == 1.0 and data.exact_match([], []) == 0.0
    with pytest.raises(ValueError, match="2 outputs for 1 answers"):
        data.exact_match(["a", "b"], ["a"])


# -- the training pieces ---------------------------------------------------------------
def test_only_the_answer_and_its_eos_are_scored() -> None:
    tok = train_tokenizer(data.corpus())
    (short, long) = encode([("reverse abc>", "cba"), ("reverse abcd>", "dcba")], tok)
    assert short[0][0] == tok.bos_token_id and short[1][-1] == tok.eos_token_id
    batch = collate([short, long], tok.pad_token_id)
    labels, ids, mask = batch["labels"][0].tolist(), batch["input_ids"][0].tolist(), batch["attention_mask"][0].tolist()
    n_prompt, n = len(short[0]), len(short[0]) + len(short[1])
    assert labels[:n_prompt] == [-100] * n_prompt and labels[n_prompt:n] == short[1] and labels[n:] == [-100] * 2
    assert ids[n:] == [tok.pad_token_id] * 2 and mask == [1] * n + [0, 0]  # one more letter, and its answer's
    assert batch["labels"][1].tolist()[-5:] == tok("dcba", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_the_learning_rate_warms_up_then_decays() -> None:
    config = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    factors = [lr_factor(s, config) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:])) and factors[-1] == pytest.approx(0.1, abs=1e-3)


def test_a_config_that_cannot_train_is_refused_when_it_is_made() -> None:
    with pytest.raises(ValueError, match="not a multiple of heads"):
        replace(TEST, hidden=65)
    with pytest.raises(ValueError, match="steps, batch_size"):
        replace(TEST, steps=0)
    with pytest.raises(ValueError, match="unknown task"):
        TrainConfig(task="reverse,rot13")
    with pytest.raises(ValueError, match="at most 64"):
        TrainConfig(letters=(3, 30))
    assert TrainConfig(task="reverse, sort").tasks == ("reverse", "sort")


# -- training --------------------------------------------------------------------------
def test_training_is_byte_for_byte_deterministic_and_its_data_reproducible(trained, tmp_path: Path) -> None:
    out, meta, lines = trained
    again = train(TEST, tmp_path / "again", log=lambda _: None)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert sha256(out / name) == sha256(tmp_path / "again" / name), name
    assert {k: v for k, v in again.metrics.items() if k != "train_seconds"} == {
        k: v for k, v in meta.metrics.items() if k != "train_seconds"
    }
    assert data.digest(generated_training_set(meta.training_data.uri)) == meta.training_data.sha256
    other = train(replace(TEST, seed=8, steps=2), tmp_path / "seed8", log=lambda _: None)
    assert sha256(tmp_path / "seed8" / "model.safetensors") != sha256(out / "model.safetensors")
    assert other.training_data.sha256 != meta.training_data.sha256
    assert any(line.startswith(f"step {TEST.log_every}/{TEST.steps}  loss") for line in lines)


def test_the_test_preset_learns_something(trained) -> None:
    _, meta, _ = trained
    assert meta.metrics["train_loss"] < 1.0  # uniform over the vocabulary would be ln(32) = 3.47
    assert meta.metrics["exact_match"] >= 0.1  # 0.22 on x86-64: words of 3-4 letters, 300 steps


def test_the_folder_loads_offline_and_evaluates_to_the_recorded_metric(trained) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, meta, _ = trained
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    assert model.config.vocab_size == len(tok) and model.config.max_position_embeddings == 64
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["pad_token_id"], gen["bos_token_id"]) == (
        tok.eos_token_id,
        tok.pad_token_id,
        tok.bos_token_id,
    )
    holdout = data.examples(TEST.holdout_examples, TEST.seed, split="holdout", letters=TEST.letters)
    assert evaluate(out, holdout) == {
        "exact_match": meta.metrics["exact_match"],
        "holdout_examples": TEST.holdout_examples,
    }
    # batched with left padding, or one at a time: the same greedy answers
    prompts = [p for p, _ in holdout[:6]]
    batched = generate(model, tok, prompts, max_new_tokens=10)
    assert batched == [generate(model, tok, [p], max_new_tokens=10)[0] for p in prompts]
    assert all(EOS not in o and PAD not in o for o in batched)


def test_metadata_names_the_task_the_contract_and_the_config(trained) -> None:
    _, meta, _ = trained
    assert meta.framework == "transformers"
    assert [(s.name, s.datatype, s.shape) for s in meta.inputs] == [("text_input", "BYTES", [-1])]
    assert [(s.name, s.datatype, s.shape) for s in meta.outputs] == [("text_output", "BYTES", [-1])]
    assert set(meta.hyperparameters) == set(vars(TEST)) | {"params_millions"}
    assert meta.hyperparameters["letters"] == list(TEST.letters) and meta.hyperparameters["hidden"] == TEST.hidden
    assert {"exact_match", "params_millions", "train_seconds"} <= set(meta.metrics)
    assert 0.0 <= meta.metrics["exact_match"] <= 1.0 and 0.01 < meta.metrics["params_millions"] < 1.0
    assert meta.metrics["params_millions"] == meta.hyperparameters["params_millions"]
    uri = meta.training_data.uri
    assert uri.startswith("generated://tiny-lm?task=reverse&") and f"n={TEST.train_examples}" in uri
    assert f"seed={TEST.seed}" in uri and "reverse" in meta.description


def test_train_and_register_stores_a_loadable_version(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    store = open_store(f"file://{tmp_path / 'store'}")
    config = replace(TEST, steps=5, holdout_examples=8)
    first = train_and_register(store, "tiny-lm-test", "1.0.0", config, log=lambda _: None)
    mv = train_and_register(store, "tiny-lm-test", "1.1.0", replace(config, seed=8), parent="1.0.0", log=lambda _: None)
    assert Registry(store).get("tiny-lm-test", "1.1.0") == mv
    assert Registry(store).versions("tiny-lm-test") == ["1.0.0", "1.1.0"]
    assert first.parent_version is None and mv.parent_version == "1.0.0" and mv.framework == "transformers"
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(mv.files)
    assert mv.files["model.safetensors"] != first.files["model.safetensors"]  # another seed, other weights
    fetched = Registry(store).fetch("tiny-lm-test", "1.1.0", tmp_path / "fetched")
    model = AutoModelForCausalLM.from_pretrained(fetched, local_files_only=True)
    assert model.num_parameters() / 1e6 == pytest.approx(mv.metrics["params_millions"], abs=1e-3)


def test_a_distilled_student_learns_the_teachers_answers_and_names_its_lineage(trained, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from bentos.tiny_lm.train import distill_and_register

    out, meta, _ = trained
    store = open_store(f"file://{tmp_path / 'store'}")
    Registry(store).register("tiny-lm-test", "1.0.0", out, meta)
    lines: list[str] = []
    student = distill_and_register(
        store, "tiny-lm-test", "1.0.0", "1.0.0-student", PRESETS["student-test"], log=lines.append
    )
    assert student.parent_version == "1.0.0" and student.hyperparameters["lineage"] == {
        "method": "distill",
        "teacher": "tiny-lm-test:1.0.0",
    }
    assert student.hyperparameters["letters"] == list(TEST.letters)  # the teacher's word lengths, not the preset's
    assert (
        student.metrics["params_millions"]
        < student.metrics["teacher_params_millions"]
        == meta.metrics["params_millions"]
    )
    assert (
        student.metrics["teacher_exact_match"] == meta.metrics["exact_match"]
        and 0 <= student.metrics["exact_match"] <= 1
    )
    assert (
        "teacher=tiny-lm-test:1.0.0" in student.training_data.uri
        and "distilled from tiny-lm-test:1.0.0" in student.description
    )
    assert any(line.startswith("teacher exact match on the training prompts") for line in lines)
    fetched = Registry(store).fetch("tiny-lm-test", "1.0.0-student", tmp_path / "student")
    assert AutoModelForCausalLM.from_pretrained(fetched, local_files_only=True).num_parameters() < 20_000


def test_fleet_models_distill_registers_a_student_and_refuses_a_family_without_distillation(tmp_path: Path) -> None:
    import subprocess

    from tests.serving_env import FLEET, FleetEnv

    env = FleetEnv(tmp_path)
    env.fleet("models", "train", "demo-lm", "1.0.0", "--preset", "test", "--steps", "20")
    student = env.fleet_json(
        "models", "distill", "demo-lm", "1.0.0", "1.0.1", "--preset", "student-test", "--steps", "10"
    )
    assert student["parent_version"] == "1.0.0" and student["hyperparameters"]["lineage"]["method"] == "distill"
    refused = subprocess.run(
        [FLEET, "models", "distill", "demo-classifier", "1.0.0", "1.0.1"],
        env=env.env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert refused.returncode != 0 and "has no distillation" in refused.stderr
    assert_quiet(refused.stdout + refused.stderr, "fleet models distill")


def test_a_quantized_version_keeps_the_parents_files_names_its_lineage_and_measures_itself(
    trained, tmp_path: Path
) -> None:
    from bentos.tiny_lm.train import QUANTIZATION, quantize_and_register

    out, meta, _ = trained
    store = open_store(f"file://{tmp_path / 'store'}")
    parent = Registry(store).register("tiny-lm-test", "1.0.0", out, meta)
    q = quantize_and_register(store, "tiny-lm-test", "1.0.0", "1.0.0-int8", log=lambda _: None)
    assert q.parent_version == "1.0.0" and q.hyperparameters["lineage"]["method"] == "quantize"
    assert q.hyperparameters["lineage"]["settings"] == {"library": "torchao", "method": "int8-weight-only"}
    assert {
        k: v for k, v in q.files.items() if k != QUANTIZATION
    } == parent.files  # the same weights, quantized at load
    assert q.metrics["weight_mib"] < 0.5 * q.metrics["parent_weight_mib"]
    assert (
        abs(q.metrics["exact_match"] - meta.metrics["exact_match"]) <= 0.1
        and q.metrics["parent_exact_match"] == meta.metrics["exact_match"]
    )
    with pytest.raises(ValueError, match="quantized already"):
        quantize_and_register(store, "tiny-lm-test", "1.0.0-int8", "1.0.0-int8-int8", log=lambda _: None)
    with pytest.raises(ValueError, match="expected one of int8-weight-only"):
        quantize_and_register(store, "tiny-lm-test", "1.0.0", "x", "int4", log=lambda _: None)
    assert set(Registry(store).versions("tiny-lm-test")) == {"1.0.0", "1.0.0-int8"}
