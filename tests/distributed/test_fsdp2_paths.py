"""FSDP2 paths of the GPU efficiency work, run over gloo with one rank on the CPU: bf16 all-gathers with
fp32 gradient reduction, one gather for a whole rollout, and weights streamed one tensor at a time."""
import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _fsdp2_scorer(tiny_model_dir, compute_dtype):
    from transformers import AutoModelForCausalLM

    from portagrpo.backends.dist import Collectives
    from portagrpo.kernels import logprob_impl
    from portagrpo.model.parallel import FSDP2
    from portagrpo.model.scorer import ResponseScorer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    strategy = FSDP2(Collectives())
    scorer = strategy.wrap(ResponseScorer(model, logprob_impl("chunked")), trainable=True, compute_dtype=compute_dtype)
    return strategy, scorer, model


def _batch(vocab=40):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (2, 8), generator=g)
    return ids, torch.ones_like(ids), ids[:, 5:], torch.ones(2, 3, dtype=torch.bool)


def test_bf16_runs_gather_bf16_parameters_and_reduce_fp32_gradients(one_rank_group, tiny_model_dir):
    strategy, scorer, model = _fsdp2_scorer(tiny_model_dir, torch.bfloat16)
    layer = model.model.layers[0]
    seen = []
    layer.mlp.register_forward_pre_hook(lambda m, a: seen.append(m.gate_proj.weight.dtype))
    ids, mask, resp, rmask = _batch()
    logp, _, _, _ = scorer(ids, mask, resp, rmask, 1.0, False, False)
    logp.sum().backward()
    assert seen == [torch.bfloat16]  # the all-gathered (unsharded) weights are bf16
    sharded = layer.mlp.gate_proj.weight
    assert sharded.dtype == torch.float32 and sharded.grad is not None and sharded.grad.dtype == torch.float32


def test_fp32_runs_keep_fp32_parameters(one_rank_group, tiny_model_dir):
    _, scorer, model = _fsdp2_scorer(tiny_model_dir, torch.float32)
    seen = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: seen.append(m.gate_proj.weight.dtype))
    scorer(*_batch(), 1.0, False, False)
    assert seen == [torch.float32]


@pytest.mark.skipif(
    not hasattr(__import__("torch.distributed.fsdp", fromlist=["FSDPModule"]).FSDPModule, "set_reshard_after_forward"),
    reason="torch < 2.8 has no set_reshard_after_forward: generation gathers per forward (slower, same result)",
)
def test_a_rollout_gathers_the_shards_once(one_rank_group, tiny_model_dir):
    from torch.distributed.tensor import DTensor

    strategy, scorer, model = _fsdp2_scorer(tiny_model_dir, None)
    layer_weight = lambda: model.model.layers[0].mlp.gate_proj.weight  # noqa: E731
    ids, mask, resp, rmask = _batch()
    with torch.no_grad():
        scorer(ids, mask, resp, rmask, 1.0, False, False)
        assert isinstance(layer_weight(), DTensor)  # outside a rollout a layer reshards after its forward
        with strategy.generation(scorer):
            for _ in range(3):  # the forwards of generate
                scorer(ids, mask, resp, rmask, 1.0, False, False)
                assert not isinstance(layer_weight(), DTensor)  # still gathered: no all-gather per token
        assert isinstance(layer_weight(), DTensor)  # resharded after the rollout
        scorer(ids, mask, resp, rmask, 1.0, False, False)
        assert isinstance(layer_weight(), DTensor)  # and resharding after forward again


def test_weights_stream_one_full_tensor_at_a_time(one_rank_group, tiny_model_dir):
    strategy, scorer, model = _fsdp2_scorer(tiny_model_dir, None)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in strategy.model_state(scorer).items()}
    streamed = strategy.full_tensors(scorer)
    first_name, first = next(streamed)  # a generator: nothing else gathered yet
    rest = dict(streamed)
    rest[first_name] = first
    # a tied lm_head is the embedding: streamed once, under the embedding's name
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert rest.keys() == full.keys() - tied
    for name, value in rest.items():
        assert not hasattr(value, "full_tensor") and torch.equal(value, full[name]), name


def test_a_scoring_pass_leaves_nothing_gathered(one_rank_group, tiny_model_dir):
    """FSDP2 keeps its root unit gathered after a forward until a backward; a reference never runs one, so without
    the release after its scoring pass its root (here the final norm, tied embedding and LM head) stayed gathered for
    the rest of the run."""
    import contextlib
    from types import SimpleNamespace

    from torch.distributed.tensor import DTensor

    from portagrpo.backends.dist import Collectives
    from portagrpo.batch import RolloutBatch
    from portagrpo.train.logprobs import LogProbs, ScoringSettings

    strategy, scorer, model = _fsdp2_scorer(tiny_model_dir, None)
    ids, mask, resp, rmask = _batch()
    rows = ids.shape[0]
    rb = RolloutBatch(ids, mask, resp, rmask.float(), torch.arange(rows), torch.arange(rows), [""] * rows,
                      [""] * rows, [""] * rows, [{}] * rows)
    settings = ScoringSettings(micro_batch_size=1, token_budget=None, temperature=1.0, scoring_pass=False)
    runtime = SimpleNamespace(comm=Collectives(), phase=lambda label: contextlib.nullcontext(),
                              autocast=contextlib.nullcontext, device=torch.device("cpu"))
    passes = LogProbs(settings, runtime, SimpleNamespace(scorer=None, ref_scorer=scorer, strategy=strategy))
    root_weight = lambda: model.model.norm.weight  # noqa: E731 - in the root unit
    with torch.no_grad():
        scorer(ids, mask, resp, rmask, 1.0, False, False)
    assert not isinstance(root_weight(), DTensor)  # what FSDP2 does by itself: the root stays gathered
    strategy.release(scorer)
    assert isinstance(root_weight(), DTensor)
    logp = passes.passes(scorer, rb, entropy=False).old
    assert logp.shape == resp.shape and isinstance(root_weight(), DTensor)  # the scoring pass released it


@pytest.mark.parametrize("ranks,dtype", [(2, "fp32"), (3, "fp32"), (4, "bf16")])
def test_a_streamed_head_and_embedding_score_and_differentiate_as_gathered_ones(tmp_path, ranks, dtype):
    """FSDP2 ranks read their untied LM head and input embedding one rank's rows at a time (model/parallel.py
    StreamedRows) and never gather them to score or train: log-probs, entropies and every whole gradient equal the
    gathered units', on 2, 3 and 4 ranks of a 101-row vocabulary (uneven rows), in fp32 and under bf16 mixed
    precision."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from portagrpo.backends.fsdp_compat import fsdp2_problem
    from portagrpo.tolerances import assert_close

    if fsdp2_problem(torch.float32):
        pytest.skip(fsdp2_problem(torch.float32))
    worker = Path(__file__).resolve().parent / "streamed_rows_worker.py"
    res = subprocess.run([sys.executable, "-m", "portagrpo.launcher", "--nproc", str(ranks), str(worker),
                          str(tmp_path), dtype], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=900, cwd="/")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    low = torch.bfloat16 if dtype == "bf16" else torch.float32
    for rank in range(ranks):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        streamed, whole = result["streamed"], result["gathered"]
        assert streamed["gathered_calls"] == streamed["gathered_lookups"] == 0
        assert whole["gathered_calls"] == whole["gathered_lookups"] == 2
        assert_close(streamed["logp"], whole["logp"], low, "logprob", "logp")
        assert_close(streamed["no_grad_logp"], whole["no_grad_logp"], low, "logprob", "no-grad logp")
        assert_close(streamed["entropy"], whole["entropy"], low, "entropy", "entropy")
        assert set(streamed["grads"]) == set(whole["grads"]) and "lm.lm_head.weight" in streamed["grads"]
        for name, grad in whole["grads"].items():
            assert_close(streamed["grads"][name], grad, low, "grad", name)


def test_a_biased_or_adapted_head_stays_a_gathered_unit(one_rank_group):
    """kernels/streamed.py computes a plain linear head: a head with a bias (Phi-2's) or one LoRA adapts is computed
    by its gathered unit, the embedding still read by rows; a plain untied head is read by rows."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from portagrpo.backends.dist import Collectives
    from portagrpo.kernels import logprob_impl
    from portagrpo.model.parallel import FSDP2
    from portagrpo.model.scorer import ResponseScorer

    def wrapped(kind: str):
        torch.manual_seed(0)
        lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False))
        if kind == "bias":
            lm.lm_head = torch.nn.Linear(16, 64, bias=True)
        if kind == "lora":
            lm = get_peft_model(lm, LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
        return FSDP2(Collectives()).wrap(ResponseScorer(lm, logprob_impl("chunked")), trainable=True)

    plain, biased, adapted = wrapped("plain"), wrapped("bias"), wrapped("lora")
    assert plain.streamed_head is not None and plain.streamed_embedding is not None
    assert biased.streamed_head is None and biased.streamed_embedding is not None
    assert adapted.streamed_head is None
    ids, mask, resp, rmask = _batch(vocab=64)
    logp, _, _, _ = biased(ids, mask, resp, rmask, 1.0, False, False)
    logp.sum().backward()  # the bias is in the computation: it gets a gradient
    assert biased.lm.lm_head.bias.grad is not None and biased.lm.lm_head.bias.grad.abs().sum() > 0
