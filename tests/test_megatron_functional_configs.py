"""Megatron-LM's own dense Llama-style functional-test configs dry-run here with their flags
unchanged (scripts/megatron_configs.py runs all of them; these four are kept literally).

Each list is `scripts/megatron_configs.py --print-argv` of the named
tests/functional_tests/test_cases/gpt/<name>/model_config.yaml at Megatron-LM's HEAD: MODEL_ARGS
as Megatron's launcher writes them, with only what points at NVIDIA's cluster swapped: the data
paths for --mock-data, the GPT-2 BPE files for a tiny vocab.json/merges.txt, the checkpoint,
TensorBoard and distillation-teacher directories for scratch ones, and the distillation YAML
for the one the test's BEFORE_SCRIPT writes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

import pretrain
from tokenizer.spec import TokenizerSpec, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("megatron_configs",
                                               ROOT / "scripts" / "megatron_configs.py")
megatron_configs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(megatron_configs)

VOCAB, MERGES, SAVE, LOAD, TB = "{vocab}", "{merges}", "{save}", "{load}", "{tb}"
TEACHER, KD_CFG = "{teacher}", "{kd_cfg}"
DISTILL_CONFIG = ('{intermediate_layer_pairs: [["decoder.final_layernorm", '
                  '"decoder.final_layernorm"]], logit_layers: ["output_layer", "output_layer"], '
                  "skip_lm_loss: true, kd_loss_scale: 1.0}")
"""The distillation test's ENV_VARS DISTILL_CONFIG, which its BEFORE_SCRIPT writes as YAML."""
ITERS = {"gpt3_mcore_te_tp2_pp1_modelopt_distill_resume": 100}
"""--train-iters where it is not 50."""

CONFIGS = {
    # TP1 x PP2 with --sequence-parallel, rerun machinery on, Llama-3-like GQA (kv-channels 128)
    "gpt3_mcore_reruns_persistent_2": [
        "--deterministic-mode", "--bf16", "--train-iters", "50", "--eval-iters", "0",
        "--manual-gc", "--use-mcore-models", "--distributed-backend", "nccl",
        "--sequence-parallel", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
        "--global-batch-size", "128", "--untie-embeddings-and-output-weights",
        "--position-embedding-type", "rope", "--rotary-percent", "1.0",
        "--max-position-embeddings", "4096", "--num-layers", "32", "--hidden-size", "3072",
        "--ffn-hidden-size", "8192", "--num-attention-heads", "32", "--num-query-groups",
        "8", "--seq-length", "4096", "--kv-channels", "128", "--group-query-attention",
        "--normalization", "RMSNorm", "--swiglu", "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--no-create-attention-mask-in-dataloader",
        "--transformer-impl", "transformer_engine", "--disable-bias-linear", "--clip-grad",
        "1.0", "--overlap-grad-reduce", "--overlap-param-gather", "--lr", "3e-4",
        "--lr-warmup-samples", "0", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--adam-eps", "1e-8", "--use-distributed-optimizer", "--split", "949,50,1",
        "--no-gradient-accumulation-fusion", "--save-interval", "10000", "--eval-interval",
        "1000", "--ckpt-format", "torch_dist", "--dist-ckpt-strictness", "log_all",
        "--save", SAVE, "--load", LOAD, "--vocab-file", VOCAB, "--merge-file", MERGES,
        "--tensorboard-dir", TB, "--timing-log-level", "0", "--log-interval", "1",
        "--log-params-norm", "--log-num-zeros-in-grad",
        "--log-validation-ppl-to-tensorboard", "--log-timers-to-tensorboard",
        "--log-memory-to-tensorboard", "--rerun-mode", "validate_results", "--async-save",
        "--use-persistent-ckpt-worker", "--mock-data"],
    # TP2 x PP2 with --sequence-parallel
    "gpt3_mcore_reruns_reshard": [
        "--deterministic-mode", "--bf16", "--train-iters", "50", "--eval-iters", "0",
        "--manual-gc", "--use-mcore-models", "--distributed-backend", "nccl",
        "--sequence-parallel", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
        "--global-batch-size", "128", "--untie-embeddings-and-output-weights",
        "--position-embedding-type", "rope", "--rotary-percent", "1.0",
        "--max-position-embeddings", "4096", "--num-layers", "32", "--hidden-size", "3072",
        "--ffn-hidden-size", "8192", "--num-attention-heads", "32", "--num-query-groups",
        "8", "--seq-length", "4096", "--kv-channels", "128", "--group-query-attention",
        "--normalization", "RMSNorm", "--swiglu", "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--no-create-attention-mask-in-dataloader",
        "--transformer-impl", "transformer_engine", "--disable-bias-linear", "--clip-grad",
        "1.0", "--overlap-grad-reduce", "--overlap-param-gather", "--lr", "3e-4",
        "--lr-warmup-samples", "0", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--adam-eps", "1e-8", "--use-distributed-optimizer", "--split", "949,50,1",
        "--no-gradient-accumulation-fusion", "--save-interval", "10000", "--eval-interval",
        "1000", "--ckpt-format", "torch_dist", "--dist-ckpt-optim-fully-reshardable",
        "--dist-ckpt-strictness", "log_all", "--save", SAVE, "--load", LOAD, "--vocab-file",
        VOCAB, "--merge-file", MERGES, "--tensorboard-dir", TB, "--timing-log-level", "0",
        "--log-interval", "1", "--log-params-norm", "--log-num-zeros-in-grad",
        "--log-validation-ppl-to-tensorboard", "--log-timers-to-tensorboard",
        "--log-memory-to-tensorboard", "--rerun-mode", "validate_results", "--async-save",
        "--use-persistent-ckpt-worker", "--mock-data"],
    # TP1 x PP4, SwiGLU; Megatron's defaults elsewhere (LayerNorm, learned positions, biases)
    "gpt3_mcore_te_tp1_pp4_swiglu": [
        "--num-layers", "12", "--hidden-size", "512", "--num-attention-heads", "8",
        "--log-params-norm", "--log-num-zeros-in-grad",
        "--log-validation-ppl-to-tensorboard", "--log-timers-to-tensorboard",
        "--tensorboard-dir", TB, "--micro-batch-size", "4", "--global-batch-size", "32",
        "--seq-length", "1024", "--max-position-embeddings", "1024", "--train-iters", "50",
        "--timing-log-level", "0", "--lr-decay-iters", "320000", "--save", SAVE, "--load",
        LOAD, "--vocab-file", VOCAB, "--merge-file", MERGES, "--split", "949,50,1",
        "--distributed-backend", "nccl", "--lr", "0.00015", "--lr-decay-style", "cosine",
        "--min-lr", "1e-05", "--weight-decay", "1e-2", "--clip-grad", "1.0",
        "--lr-warmup-fraction", "0.01", "--log-interval", "1", "--save-interval", "10000",
        "--eval-interval", "1000", "--eval-iters", "10", "--transformer-impl",
        "transformer_engine", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "4", "--swiglu", "--ckpt-fully-parallel-load",
        "--async-save", "--deterministic-mode", "--no-gradient-accumulation-fusion",
        "--attention-softmax-in-fp32", "--use-mcore-models", "--ckpt-format", "torch_dist",
        "--dist-ckpt-strictness", "log_all", "--bf16", "--attention-backend", "unfused",
        "--log-memory-to-tensorboard", "--use-persistent-ckpt-worker", "--mock-data"],
    # TP2 with SP, distillation from a teacher (ModelOpt's flags, the test's BEFORE_SCRIPT YAML;
    # the teacher's directory is empty here: the dry run plans one of the student's shape),
    # partial RoPE (--rotary-percent 0.5)
    "gpt3_mcore_te_tp2_pp1_modelopt_distill_resume": [
        "--export-te-mcore-model", "--export-kd-teacher-load", TEACHER, "--export-kd-cfg",
        KD_CFG, "--auto-detect-ckpt-format", "--num-layers", "12", "--hidden-size", "512",
        "--num-attention-heads", "8", "--normalization", "RMSNorm", "--log-params-norm",
        "--log-num-zeros-in-grad", "--log-validation-ppl-to-tensorboard",
        "--log-timers-to-tensorboard", "--tensorboard-dir", TB, "--micro-batch-size", "2",
        "--global-batch-size", "16", "--seq-length", "1024", "--max-position-embeddings", "1024",
        "--position-embedding-type", "rope", "--no-rope-fusion", "--rotary-percent", "0.5",
        "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--train-iters", "100", "--timing-log-level", "0", "--lr-decay-iters", "320000", "--save",
        SAVE, "--load", LOAD, "--vocab-file", VOCAB, "--merge-file", MERGES, "--split", "949,50,1",
        "--distributed-backend", "nccl", "--lr", "0.00015", "--lr-decay-style", "cosine",
        "--min-lr", "1e-05", "--weight-decay", "1e-2", "--clip-grad", "1.0",
        "--lr-warmup-fraction", "0.01", "--use-distributed-optimizer", "--log-interval", "1",
        "--save-interval", "50", "--eval-interval", "1000", "--eval-iters", "10",
        "--transformer-impl", "transformer_engine", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "1", "--sequence-parallel", "--deterministic-mode",
        "--no-gradient-accumulation-fusion", "--use-checkpoint-opt_param-scheduler",
        "--ckpt-format", "torch_dist", "--dist-ckpt-strictness", "log_all", "--bf16",
        "--attention-backend", "unfused", "--log-memory-to-tensorboard", "--async-save",
        "--use-persistent-ckpt-worker", "--exit-interval", "100", "--mock-data"],
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_megatron_functional_config_dry_runs(name: str, tmp_path, capsys) -> None:
    """`pretrain.py --dry-run --world-size 8` with the config's flags exits 0."""
    vocab, merges = megatron_configs.write_gpt2_bpe(tmp_path)
    paths = {"{vocab}": str(vocab), "{merges}": str(merges)}
    for key in ("save", "load", "tb", "teacher"):
        (tmp_path / key).mkdir()
        paths["{" + key + "}"] = str(tmp_path / key)
    paths[KD_CFG] = str(tmp_path / "distill_config.yaml")
    (tmp_path / "distill_config.yaml").write_text(yaml.safe_dump(yaml.safe_load(DISTILL_CONFIG)))
    argv = [paths.get(a, a) for a in CONFIGS[name]]
    rc = pretrain.main(["--dry-run", "--world-size", "8", *argv])
    captured = capsys.readouterr()
    assert rc == 0, captured.err + captured.out[-2000:]
    assert f"dry run: iters {ITERS.get(name, 50)} (--train-iters)" in captured.out
    if TEACHER in CONFIGS[name]:
        assert "planned with the student's shape (its weights counted in mem_gib)" in captured.out


@pytest.mark.quick
def test_model_args_become_megatron_command_lines(tmp_path) -> None:
    """true -> switch, false -> omitted, list -> items, data -> --mock-data, tokenizer files ->
    the built ones, ${VAR} paths -> scratch directories, ${REPEAT} -> 1; MODEL_ARGS_<n>
    variants with their MODEL_ENV_VARS GPUS_PER_NODE."""
    text = """
MODEL_ENV_VARS:
  MODEL_ARGS_2:
    GPUS_PER_NODE: 2
BASE: &BASE
  --bf16: true
  --fp16: false
  --seed: ${REPEAT}
  --rampup-batch-size: [16, 16, 64]
  --data-path: ${DATA_PATH}/text/my-gpt3_00_text_document
  --data-cache-path: ${DATA_CACHE_PATH}
  --vocab-file: ${DATA_PATH}/bpe/vocab.json
  --save: ${CHECKPOINT_SAVE_PATH}
MODEL_ARGS:
  <<: *BASE
  --lr: 3e-4
MODEL_ARGS_2:
  <<: *BASE
  --lr: .01
"""
    tokenizer = megatron_configs.write_gpt2_bpe(tmp_path)
    got = [(key, megatron_configs.to_argv(flags, tmp_path / key, tokenizer), gpus)
           for key, flags, gpus in megatron_configs.variants(text)]
    base = ["--bf16", "--seed", "1", "--rampup-batch-size", "16", "16", "64", "--vocab-file",
            str(tokenizer[0]), "--save", str(tmp_path / "{key}" / "save")]
    assert got == [
        ("MODEL_ARGS", [*[a.format(key="MODEL_ARGS") for a in base], "--lr", "3e-4",
                        "--mock-data"], None),
        ("MODEL_ARGS_2", [*[a.format(key="MODEL_ARGS_2") for a in base], "--lr", "0.01",
                          "--mock-data"], 2)]
    assert (tmp_path / "MODEL_ARGS" / "save").is_dir()
    # the built files are a GPT-2 byte-level BPE: ASCII bytes keep their ids, then the merges
    tok = load_tokenizer(TokenizerSpec(tokenizer_type="GPT2BPETokenizer",
                                       vocab_file=str(tokenizer[0]), merge_file=str(tokenizer[1])))
    assert tok.encode(["the them"]) == [[ord("t"), 257, 258, ord("m")]]  # t|he, Ġthe|m
    assert tok.vocab_size == 260
