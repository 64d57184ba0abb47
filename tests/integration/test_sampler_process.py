"""How the one_step_off sampler process is fed (issue 31 item 7, issue 32 item 6): a weight push is one
host copy in the sampler's precision and puts nothing in shared memory, the weights that arrive are the
ones pushed, and a kill -9 of a whole run leaves nothing in /dev/shm or in the temporary folder."""
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from portagrpo.data.records import PromptRecord
from portagrpo.rollout.generators import RoundPrompts
from portagrpo.rollout.process import SamplerProcess, SamplerSpec
from portagrpo.rollout.sampler_copy import SamplerCopy
from portagrpo.rollout.settings import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


class Tokenizer:
    """What the sampler process reads of a tokenizer: its special ids, and decoding (the text generator's)."""

    eos_token_id = 0
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


TOKENIZER = Tokenizer()
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _bench():
    spec = importlib.util.spec_from_file_location("push_copies", ROOT / "bench" / "push_copies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the sampler process runs (SamplerSpec.threads), so greedy picks agree
    yield
    torch.set_num_threads(before)


def _models(tmp_path, count):
    bench = _bench()
    models = []
    for seed in range(count):
        models.append(bench.model_of(64, 2, 300))
        torch.manual_seed(100 + seed)  # each its own weights
        models[-1].load_state_dict({k: torch.randn_like(v) * 0.2 for k, v in models[-1].state_dict().items()})
    models[0].save_pretrained(tmp_path / "init")
    return bench, models


def _prompts():
    ids = torch.randint(3, 300, (2, 5), generator=torch.Generator().manual_seed(0))
    return ids, torch.ones_like(ids)


def _round():
    """`_prompts` as a round for the process's text generator: two records, one sample each, 5 tokens wide."""
    records = [PromptRecord(i, "", "", "x") for i in range(2)]
    return RoundPrompts(records, _prompts()[0].tolist(), None, 0), 1, GREEDY, 5


def test_a_push_is_one_host_copy_in_the_samplers_precision(tmp_path, one_thread):
    bench, (init, pushed) = _models(tmp_path, 2)
    bf16_bytes = sum(p.numel() * 2 for p in pushed.parameters())
    sampler = SamplerProcess(SamplerSpec(str(tmp_path / "init"), "sdpa", TOKENIZER, "bf16", False, 1))
    try:
        with bench.HostTraffic() as traffic:
            sampler.update_weights(pushed.named_parameters())
            sampler.submit(*_round(), seed=0)
            remote = sampler.result().rollout  # taken after the weights, which the process loads first
    finally:
        sampler.close()
    # once, in bf16: no clone of the fp32 weights, nothing moved into /dev/shm (before: 2x fp32 on the CPU)
    assert traffic.shared == 0
    assert bf16_bytes <= traffic.copied < 1.1 * bf16_bytes
    local = SamplerCopy(pushed, TOKENIZER, "bf16").generate(*_prompts(), GREEDY)
    assert torch.equal(remote.responses, local.responses)


def test_every_push_arrives_in_order(tmp_path, one_thread):
    """Pushes reuse the staging buffer: the second waits until the process has loaded the first."""
    _, (init, first, second) = _models(tmp_path, 3)
    sampler = SamplerProcess(SamplerSpec(str(tmp_path / "init"), "sdpa", TOKENIZER, "fp32", False, 1))
    try:
        sampler.update_weights(first.named_parameters())
        sampler.submit(*_round(), seed=0)  # sampled with `first`
        sampler.update_weights(second.named_parameters())  # queued behind the request
        with_first = sampler.result().rollout
        sampler.submit(*_round(), seed=0)
        with_second = sampler.result().rollout
    finally:
        sampler.close()
    for remote, model in ((with_first, first), (with_second, second)):
        local = SamplerCopy(model, TOKENIZER, "fp32").generate(*_prompts(), GREEDY)
        assert torch.equal(remote.responses, local.responses)
    assert not torch.equal(with_first.responses, with_second.responses)


FAST = ["trainer.progress_bar=false", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=4", "data.train_size=32", "trainer.test_freq=0", "trainer.save_freq=0",
        "data.max_response_length=8", "trainer.tensorboard=false", "trainer.plot=false", "trainer.total_steps=200"]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this system")
def test_kill_9_of_a_one_step_off_run_leaves_nothing_behind(tmp_path):
    """The run, its reward workers, its sampler process and multiprocessing's resource tracker all die at
    once: whatever they named in /dev/shm or in the temporary folder would stay there for good."""
    shm, tmpdir, run = Path("/dev/shm"), tmp_path / "tmp", tmp_path / "run"
    tmpdir.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmpdir), "PYTHONUNBUFFERED": "1"}
    before = set(os.listdir(shm))
    proc = subprocess.Popen([sys.executable, "-m", "portagrpo", "train", "--output-dir", str(run),
                             "rollout.mode=one_step_off", *FAST], cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        metrics = run / "metrics.jsonl"
        # two steps logged: a push was made and the next request is in flight
        while proc.poll() is None and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for _ in range(600):  # the group's other processes are reaped by init; wait until none is left
            if not _group_alive(proc.pid):
                break
            time.sleep(0.1)
    assert not _group_alive(proc.pid)
    assert set(os.listdir(shm)) - before == set()
    assert list(tmpdir.glob("pymp-*")) == []
