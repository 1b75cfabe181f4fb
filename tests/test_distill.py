"""Knowledge distillation (--export-kd-teacher-load, --export-kd-cfg; megatron_lite/distill.py).

- The vocab-parallel KL equals KL(teacher || student) written with full-vocabulary softmaxes
  (padding columns excluded), and a teacher equal to the student gives zero loss and zero
  gradient (float64).
- A whole distillation run at TP=2 with sequence parallelism (the teacher, saved at TP=1 with
  another depth, resharded on load) logs the same LM loss, grad norms and distillation terms
  as one process (float64, EXACT); with the LM loss on and a final-norm pair, so every term
  of ModelOpt's balance is in the gradient.
- A tiny run with the functional test's YAML lowers the distillation loss.
- Missing teacher, missing config file, unknown keys, another vocabulary: one `error:` line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

import pretrain
from megatron_lite.arguments import parse_config
from megatron_lite.distill import (
    DistillationChunk,
    DistillConfig,
    combine,
    vocab_parallel_kl,
)
from megatron_lite.layers.context import LayerContext
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel.state import single_process_state
from megatron_lite.planner import KD_VOCAB_BUFFERS, estimate_memory
from megatron_lite.training import train
from tests.checkpoint.common import FLAGS
from tests.distributed import run_ranks
from tests.numerics import EXACT, assert_close
from tests.test_pretrain import Run, assert_same_run

PAIR_CFG = ("intermediate_layer_pairs: [[decoder.final_layernorm, decoder.final_layernorm]]\n"
            "skip_lm_loss: false\nkd_loss_scale: 2.0\nlogit_kl_temperature: 2.0\n")
"""The TP test's loss: LM loss on, the pair, a scale and a temperature (all in the gradient)."""
FUNCTIONAL_CFG = ('{intermediate_layer_pairs: [["decoder.final_layernorm", '
                  '"decoder.final_layernorm"]], logit_layers: ["output_layer", "output_layer"], '
                  "skip_lm_loss: true, kd_loss_scale: 1.0}")
"""DISTILL_CONFIG of Megatron's gpt3_mcore_te_tp2_pp1_modelopt_distill_resume."""
TERMS = ("total loss", "logits distillation loss", "intermediate distillation loss")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A 1-layer teacher (the students have 2) trained 4 steps and saved at TP=1."""
    root = tmp_path_factory.mktemp("teacher")
    train(parse_config([*FLAGS, "--num-layers", "1", "--seed", "7", "--save", str(root / "ckpt"),
                        "--save-interval", "4"]), single_process_state())
    (root / "pairs.yaml").write_text(PAIR_CFG)
    return root


def _chunk(seed: int) -> LlamaChunk:
    cfg = parse_config([*FLAGS, "--num-layers", "1", "--seed", str(seed)])
    ctx = LayerContext.from_state(single_process_state(), seed=seed, dtype=torch.float64)
    return LlamaChunk(cfg.model, ctx, [0], pre_process=True, post_process=True)


@pytest.mark.quick
def test_kl_is_the_full_vocabulary_formula_and_zero_for_an_equal_teacher() -> None:
    gen = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(5, 2, 104, generator=gen, dtype=torch.float64)
                        for _ in range(2))
    student[..., 97:] = 50.0  # padding columns: must take no part
    got = vocab_parallel_kl(student, teacher, 0, 97, None, temperature=2.0)
    log_q, log_p = (F.log_softmax(x[..., :97] / 2.0, dim=-1) for x in (student, teacher))
    want = (log_p.exp() * (log_p - log_q)).sum(-1)
    assert_close(got, want, tol=EXACT, what="KL")

    # teacher == student: every term and every gradient vanishes
    model, copy = _chunk(3), _chunk(3)
    kd = DistillationChunk(model, copy, DistillConfig(intermediate_losses=("cosine",)))
    tokens = torch.randint(0, 97, (2, 16), generator=gen)
    parts = combine(kd(tokens, tokens.roll(-1, 1)), torch.ones(2, 16, dtype=torch.float64),
                    torch.tensor(32.0, dtype=torch.float64), kd.dcfg)
    assert parts["lm loss"] > 1  # a real LM loss, logged as such
    for name in TERMS:
        assert abs(parts[name].item()) < 1e-12, (name, parts[name])
    parts["total loss"].backward()
    worst = max(p.grad.abs().max().item() for p in model.parameters())
    assert worst < 1e-10, worst
    assert all(p.grad is None for p in copy.parameters())  # frozen: nothing flows into it


def _distill(pstate, log_dir: Path, flags: list[str]) -> dict:
    return _run_logged(pstate, flags, log_dir / "tp2.jsonl")


def _run_logged(pstate, flags: list[str], log: Path) -> dict:
    result = train(parse_config([*flags, "--log-jsonl", str(log)]), pstate)
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    records = [r for r in records if "grad_norm" in r]
    return {"losses": result.losses, "norms": [r["grad_norm"] for r in records],
            **{name: [r[name] for r in records] for name in TERMS}}


def test_tp2_sequence_parallel_distillation_equals_one_process(teacher, tmp_path) -> None:
    flags = [*FLAGS, "--num-layers", "2", "--train-iters", "2", "--export-kd-teacher-load",
             str(teacher / "ckpt"), "--export-kd-cfg", str(teacher / "pairs.yaml"),
             "--log-interval", "1"]
    ref = _run_logged(single_process_state(), flags, tmp_path / "ref.jsonl")
    tp2 = [*flags, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    got = run_ranks(_distill, 2, tmp_path, cfg=parse_config(tp2), timeout=120,
                    log_dir=tmp_path, flags=tp2)[0]
    assert_same_run(_as_run(got), _as_run(ref), steps=2, evals=0)
    for name in TERMS:
        for a, b in zip(got[name], ref[name], strict=True):
            assert_close(a, b, tol=EXACT, what=name)
    assert all(v > 0 for v in ref["intermediate distillation loss"])


def _as_run(d: dict) -> Run:
    return Run(d["losses"], d["norms"], [])


def test_a_tiny_distillation_run_lowers_the_distillation_loss(teacher, tmp_path, capsys) -> None:
    cfg_file = tmp_path / "distill.yaml"
    cfg_file.write_text(yaml.safe_dump(yaml.safe_load(FUNCTIONAL_CFG)))
    flags = [f for f in FLAGS if f != "--fp64"]
    run = _run_logged(single_process_state(), [
        *flags, "--num-layers", "2", "--export-kd-teacher-load", str(teacher / "ckpt"),
        "--export-kd-cfg", str(cfg_file), "--log-interval", "1", "--train-iters", "6",
        "--lr", "1e-2"],
        tmp_path / "log.jsonl")
    total = run["total loss"]
    assert len(total) == 6 and total[-1] < 0.7 * total[0], total
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("iter      6/"))
    assert f"| total loss {total[-1]:.4f} | logits distillation loss" in line, line


@pytest.mark.parametrize(("extra", "message"), [
    (["--export-kd-teacher-load", "{tmp}/nowhere"], "--export-kd-teacher-load {tmp}/nowhere: no "
     "checkpoint there"),
    (["--export-kd-teacher-load", "{ckpt}", "--export-kd-cfg", "{tmp}/missing.yaml"],
     "--export-kd-cfg {tmp}/missing.yaml: cannot read it"),
    (["--export-kd-teacher-load", "{ckpt}", "--export-kd-cfg", "{bad}"],
     "unsupported key(s) criterion"),
    (["--export-kd-teacher-load", "{ckpt}", "--vocab-size", "90"],
     "the teacher's vocabulary has 97 tokens, the student's 90"),
    (["--export-kd-cfg", "{bad}"], "--export-kd-cfg configures distillation"),
], ids=["no-teacher", "no-cfg", "unknown-key", "vocab", "cfg-alone"])
def test_bad_distillation_input_is_one_error_line(teacher, tmp_path, capsys, extra,
                                                  message) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("criterion: {}\n")
    paths = {"{tmp}": str(tmp_path), "{ckpt}": str(teacher / "ckpt"), "{bad}": str(bad)}

    def fill(text: str) -> str:
        for key, value in paths.items():
            text = text.replace(key, value)
        return text

    rc = pretrain.main([*FLAGS, *map(fill, extra)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert fill(message) in err[0], err[0]


def test_the_planner_counts_the_teacher() -> None:
    """mem_gib grows by the teacher's weights (counted on the built model) and the KL's
    vocabulary-sized buffers: its logits plus KD_VOCAB_BUFFERS fp32 copies per token."""
    cfg = parse_config([f for f in FLAGS if f != "--fp64"])
    teacher = _chunk(0)  # 1 layer, the student's width and vocabulary
    weights = sum(p.numel() for p in teacher.parameters())
    tokens = cfg.model.seq_length * cfg.train.micro_batch_size
    want = 4 * weights + (4 + 4 * KD_VOCAB_BUFFERS) * tokens * cfg.model.padded_vocab_size(1)
    with_teacher = estimate_memory(cfg, 1, teacher=parse_config([*FLAGS, "--num-layers",
                                                                 "1"]).model)
    assert with_teacher.total_bytes - estimate_memory(cfg, 1).total_bytes == want
