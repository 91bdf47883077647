"""Hugging Face export and import end to end, as users run them (train.py, then the command lines).

Smoke-trained vanilla and DIFF checkpoints (TP=1) and a DIFF checkpoint saved at TP=2 are exported once; the
exported models must compute the framework's function (logits within 1e-4 in fp32, the same mean NLL) through
``AutoModelForCausalLM`` with no custom code, and ``AutoTokenizer`` must give the ids the model trained on. A Llama
built locally by transformers (random weights) is imported, must compute transformers' function, must train at
TP=2 as DEX's base, and must export back to the same tensors. Bad inputs end with one ``error:`` line.
"""

import gzip
import json
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

from diff_transformer.training.checkpoint import read_trainer_state, resolve_checkpoint_path
from tests.train_runs import REPO, read_metrics, run_train, train_command, train_env

SMOKE = ["experiment=smoke", "trainer.max_steps=6", "optim.warmup_steps=1", "trainer.eval_interval=0",
         "trainer.micro_batch_size=2", "trainer.global_batch_size=4"]
RUNS = {  # name: (overrides, processes)
    "vanilla": (["model.attention=vanilla"], 1),
    "diff": (["model.attention=diff"], 1),
    "diff_tp2": (["model.attention=diff", "parallel.tp=2"], 2),
}


def cli(module, *args, expect_rc=0):
    proc = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=train_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect_rc, f"{module} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def single_error_line(proc) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


def refused(main, args, capsys) -> str:
    """Run a command line's main() in this process (the refusals come before any heavy work); its one error line."""
    assert main([str(a) for a in args]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    return errors[0]


def corpus_text(chars: int = 20000) -> str:
    text = ""
    with gzip.open(REPO / "data" / "corpus" / "shakespeare_kjv.jsonl.gz", "rt") as f:
        for line in f:
            text += json.loads(line)["text"]
            if len(text) >= chars:
                break
    return text[:chars]


def run_all(commands):
    """Run the commands two at a time (the CI machine has two cores); fail on the first that does not exit 0."""
    pending = list(commands)
    while pending:
        batch, pending = pending[:2], pending[2:]
        procs = [subprocess.Popen(cmd, cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for cmd in batch]
        for cmd, proc in zip(batch, procs):
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{out[-2000:]}\n{err[-4000:]}"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    run_all([train_command(root / name, SMOKE + overrides, nproc) for name, (overrides, nproc) in RUNS.items()
             if nproc == 1])
    run_train(root / "diff_tp2", SMOKE + RUNS["diff_tp2"][0], nproc=2)
    run_all([[sys.executable, "-m", "diff_transformer.export", str(root / name), "--format", "hf", "--out",
              str(root / f"{name}_hf")] for name in RUNS])
    return root


def framework_model(path):
    from diff_transformer.training.checkpoint_tools import load_single_rank_model

    return load_single_rank_model(resolve_checkpoint_path(str(path)), torch.float32)


def framework_tokenizer(cfg):
    from data.datasets import load_tokenizer, prepare

    return load_tokenizer(prepare(cfg.data).tokenizer_dir)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(RUNS))
def test_exported_model_computes_the_framework_function(exported, name, megatron_single_process):
    from diff_transformer.training.steps import loss_func

    chunk, cfg, _ = framework_model(exported / name)
    s = cfg.model.seq_length
    ids = framework_tokenizer(cfg).encode(corpus_text())
    batch = torch.tensor(ids[: 2 * (s + 1)]).view(2, s + 1)
    tokens, labels = batch[:, :-1], batch[:, 1:]
    positions = torch.arange(s)[None].expand_as(tokens)
    with torch.no_grad():
        ours = chunk(tokens, positions, None)
        per_token = chunk(tokens, positions, None, labels=labels)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported / f"{name}_hf", dtype=torch.float32)
    assert type(model).__name__ == ("DiffLlamaForCausalLM" if name.startswith("diff") else "LlamaForCausalLM")
    with torch.no_grad():
        out = model(tokens, labels=tokens)  # transformers shifts: positions 0..s-2 predict tokens 1..s-1
    assert (ours - out.logits).abs().max().item() < 1e-4
    mask = torch.ones_like(tokens)
    mask[:, -1] = 0  # the framework's last position predicts a token beyond the batch
    ours_nll, _ = loss_func(mask, per_token)
    assert abs(float(ours_nll) - float(out.loss)) < 1e-5


@pytest.mark.multiproc
def test_autotokenizer_gives_the_framework_ids(exported, megatron_single_process):
    from diff_transformer.training.checkpoint_tools import saved_config

    cfg, _ = saved_config(resolve_checkpoint_path(str(exported / "vanilla")))
    ours = framework_tokenizer(cfg)
    theirs = transformers.AutoTokenizer.from_pretrained(exported / "vanilla_hf")
    text = corpus_text()
    ids = theirs(text)["input_ids"]
    assert ids == ours.encode(text)  # no BOS, no EOS added
    assert theirs.decode(ids) == text
    # BOS is the end-of-document token, which precedes a document in training; neither is added
    assert theirs.eos_token_id == ours.eod and theirs.bos_token_id == ours.eod
    generation = json.loads((exported / "vanilla_hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == ours.eod


LM_EVAL_TASK = REPO / "tests" / "lm_eval_tasks" / "corpus_cloze.yaml"


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["vanilla", "diff"])
def test_lm_eval_scores_the_export_as_the_framework_does(exported, name, megatron_single_process, tmp_path,
                                                         monkeypatch):
    """lm-eval-harness (offline, in this process, ``--model hf`` as a user runs it) on the repository's 20-item task:
    its per-choice log-likelihoods and accuracy equal the framework's own scoring of the checkpoint; its document
    prefix for perplexity is the end-of-document token, so a document's log-likelihood equals the framework's after
    ``</s>``, as training shows it."""
    import yaml

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from diff_transformer.evaluation.choices import read_items, score_multiple_choice
    from diff_transformer.evaluation.inference import load_for_inference, load_run_tokenizer, resolve_run

    task = yaml.safe_load(LM_EVAL_TASK.read_text())
    items_path = REPO / task["dataset_kwargs"]["data_files"]["test"]
    task["dataset_kwargs"]["data_files"]["test"] = str(items_path)  # the YAML's path is from the repository root
    lm = HFLM(pretrained=str(exported / f"{name}_hf"), dtype="float32", device="cpu", batch_size=8)
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], log_samples=True, verbosity="ERROR",
                                  task_manager=TaskManager(include_defaults=False))  # no index of lm-eval's own tasks
    samples = sorted(out["samples"]["corpus_cloze"], key=lambda sample: sample["doc_id"])
    theirs = [[float(ll) for ll, _ in sample["filtered_resps"]] for sample in samples]

    run = resolve_run(str(exported / name))
    model, tokenizer = load_for_inference(run), load_run_tokenizer(run)
    ours = score_multiple_choice(model, tokenizer, read_items(str(items_path)))
    assert len(theirs) == len(ours.loglikelihoods) == 20
    assert torch.tensor(theirs).double() == pytest.approx(torch.tensor(ours.loglikelihoods).double(), abs=1e-4)
    assert out["results"]["corpus_cloze"]["acc,none"] == ours.accuracy
    print(f"{name}: lm-eval accuracy {out['results']['corpus_cloze']['acc,none']:.2f}, framework {ours.accuracy:.2f}")

    document = "And God said, Let there be light: and there was light."
    ids = tokenizer.encode(document)
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (document,), 0)])
    framework = -float(model.token_nll(torch.tensor([[tokenizer.eod] + ids])).double().sum())
    assert rolling == pytest.approx(framework, abs=1e-4)
    assert lm.prefix_token_id == tokenizer.eod


# ------------------------------------------------------------------------------------------------------------------
# Import
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A Llama built by transformers from a config (GQA, untied, RoPE θ 500000), saved, imported."""
    root = tmp_path_factory.mktemp("import")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    transformers.LlamaForCausalLM(config).save_pretrained(root / "llama")
    cli("diff_transformer.import_hf", root / "llama", "--out", root / "checkpoint")
    return root


@pytest.mark.multiproc
def test_imported_llama_computes_the_transformers_function(imported, megatron_single_process):
    chunk, cfg, _ = framework_model(imported / "checkpoint")
    m = cfg.model
    assert (m.num_heads, m.num_kv_heads, m.rope_base, m.norm_eps, m.share_embeddings) == (4, 2, 500000.0, 1e-6, False)
    torch.manual_seed(1)
    tokens = torch.randint(0, 4096, (2, 64))
    with torch.no_grad():
        ours = chunk(tokens, torch.arange(64)[None].expand_as(tokens), None)
    model = transformers.AutoModelForCausalLM.from_pretrained(imported / "llama", dtype=torch.float32)
    with torch.no_grad():
        theirs = model(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4


def test_import_then_export_gives_back_the_same_weights(imported):
    from safetensors.torch import load_file

    cli("diff_transformer.export", imported / "checkpoint", "--format", "hf", "--out", imported / "back",
        "--tokenizer", "none")
    original, back = load_file(imported / "llama" / "model.safetensors"), load_file(imported / "back" / "model.safetensors")
    assert sorted(original) == sorted(back)
    assert all(torch.equal(original[k], back[k]) for k in original)
    a, b = (json.loads((imported / d / "config.json").read_text()) for d in ("llama", "back"))
    keys = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "intermediate_size",
            "num_hidden_layers", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "vocab_size")
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


@pytest.mark.multiproc
def test_imported_checkpoint_adapts_with_dex_at_tp2(imported, tmp_path, megatron_single_process):
    """load_weights_only at TP=2 from the TP=1 import; DEX calibrates over both ranks' heads and saves W_D under
    each head's global index; the adapted model exports as a Llama with W_D folded into o_proj."""
    from megatron.core import dist_checkpointing

    from diff_transformer.import_hf import overrides_for

    model = read_trainer_state(str(imported / "checkpoint"))["config"]["model"]
    # the overrides import_hf prints, but the debug preset's name and sequence length (free for a weights-only start)
    printed = {k: v for k, v in model.items() if k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                                          "head_dim", "ffn_hidden_size", "vocab_size", "share_embeddings",
                                                          "norm_eps", "rope_base")}
    run_train(tmp_path, SMOKE + overrides_for(printed) + [
        "model.attention=dex", "parallel.tp=2", "model.dex.calibration_samples=4", "trainer.max_steps=2",
        f"checkpoint.load_weights_only={imported / 'checkpoint'}",
    ], nproc=2)
    heads = read_trainer_state(str(tmp_path / "checkpoints" / "step_00000002"))["config"]["model"]["dex"]["heads"]
    assert [len(h) for h in heads] == [4, 4]  # half of each layer's 8 heads
    saved = dist_checkpointing.load_tensors_metadata(str(tmp_path / "checkpoints" / "step_00000002"))
    w_d = sorted(k.rsplit(".w_d.", 1)[1] for k in saved if k.startswith("decoder.") and ".w_d." in k)
    assert w_d == sorted(f"layer_{layer}.head_{h}" for layer, hs in enumerate(heads, 1) for h in hs)
    assert all(r["loss"] == r["loss"] for r in read_metrics(tmp_path))

    exported = tmp_path.parent / f"{tmp_path.name}-hf"  # beside the run: an export never writes inside its input
    cli("diff_transformer.export", tmp_path, "--format", "hf", "--out", exported)
    chunk, cfg, _ = framework_model(tmp_path)
    assert any(p.abs().max() > 0 for name, p in chunk.named_parameters() if ".w_d." in name)  # adapted, not the base
    tokens = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = chunk(tokens, torch.arange(64)[None].expand_as(tokens), None)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4


# ------------------------------------------------------------------------------------------------------------------
# Bad input: one error line each
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["diff_v2", "no_such_kind"])
def test_export_refuses_a_kind_without_an_architecture(exported, tmp_path, kind, capsys):
    from diff_transformer.export import main

    fake = tmp_path / "checkpoint"
    shutil.copytree(resolve_checkpoint_path(str(exported / "vanilla")), fake)
    state = json.loads((fake / "trainer_state.json").read_text())
    state["config"]["model"]["attention"] = kind
    (fake / "trainer_state.json").write_text(json.dumps(state))
    message = refused(main, [fake, "--format", "hf", "--out", tmp_path / "out"], capsys)
    assert kind in message and ("no architecture" in message or "not an attention kind" in message)
    assert not (tmp_path / "out").exists()


def _edited_llama(imported, tmp_path, **changes):
    target = tmp_path / "edited"
    shutil.copytree(imported / "llama", target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("changes, message", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    ({"vocab_size": 4224}, "vocabulary mismatch"),
    ({"num_key_value_heads": 1}, "must be even"),
    ({"num_attention_heads": 16, "head_dim": 8}, "head layout mismatch"),
])
def test_import_refuses_what_is_not_a_matching_llama(imported, tmp_path, changes, message, capsys):
    from diff_transformer.import_hf import main

    assert message in refused(main, [_edited_llama(imported, tmp_path, **changes), "--out", tmp_path / "out"], capsys)
    assert not (tmp_path / "out").exists()


class _Payload:
    """What a hostile pytorch_model.bin carries: unpickling it would call os.mkdir(path)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import os

        return os.mkdir, (str(self.path),)


def test_import_refuses_a_pickle_that_holds_more_than_tensors(tmp_path, capsys):
    from diff_transformer.import_hf import main

    llama = tmp_path / "llama"
    transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                             num_attention_heads=4, max_position_embeddings=64,
                             architectures=["LlamaForCausalLM"]).save_pretrained(llama)
    torch.save({"model.norm.weight": torch.ones(64), "x": _Payload(tmp_path / "ran")}, llama / "pytorch_model.bin")
    message = refused(main, [llama, "--out", tmp_path / "out"], capsys)
    assert "pytorch_model.bin holds objects besides tensors" in message and "model.safetensors" in message
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def test_dex_refuses_an_already_differential_checkpoint(exported, tmp_path):
    proc = run_train(tmp_path, SMOKE + ["model.attention=dex",
                                        f"checkpoint.load_weights_only={exported / 'diff'}"], expect_rc=2)
    assert "already differential (model.attention=diff)" in single_error_line(proc)


@pytest.mark.multiproc
def test_document_masked_scoring_equals_the_export_fed_one_document_at_a_time(exported, megatron_single_process):
    """evaluate's inference model with document masking (--document-mask on) scores a stream of two documents as the
    exported DiffLlama scores each document alone (transformers attends across documents unless fed one at a time:
    export_info.json says so); without the mask the second document's logits differ."""
    from diff_transformer.evaluation.inference import load_for_inference, resolve_run

    run = resolve_run(str(exported / "diff"))
    tokenizer = framework_tokenizer(run.typed_config())
    text = corpus_text(3000)
    first, second = tokenizer.encode(text[:700])[:20], tokenizer.encode(text[1500:2200])
    second = second[:run.seq_length - len(first) - 1]  # one sample of the model's length
    stream = torch.tensor(first + [tokenizer.eod] + second)[None]
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported / "diff_hf", dtype=torch.float32)
    masked = load_for_inference(run, document_mask=True)
    with torch.no_grad():
        ours = masked.logits(stream)[0]
        alone = [hf(torch.tensor(doc)[None]).logits[0] for doc in (first + [tokenizer.eod], second)]
    assert (ours - torch.cat(alone)).abs().max().item() < 1e-4
    masked.document_mask = False
    with torch.no_grad():
        across = masked.logits(stream)[0]
    assert (across[len(first) + 1:] - alone[1]).abs().max().item() > 1e-2
    assert "attends across documents" in json.loads((exported / "diff_hf" / "export_info.json").read_text())["documents"]
