"""Router replay R3 through vLLM (issue 43): the engine asks vLLM for the experts it routed each token to
(`enable_return_routed_experts`), places them on the rollout's grid and the update replays them. Against the stand-in
of tests/standins/fake_vllm.py playing a GPU build, whose routes are its router's choices on the pushed weights (a
forward of the checkpoint it was sent): the trainer's live router agrees with them, so they reached the right
(token, layer) cells. Playing vLLM's CPU build, the engine refuses in one sentence with vLLM's own reason (the
capture is wired to its GPU model runners only); tests/real_vllm checks that against the real CPU build."""
import sys
from pathlib import Path

import pytest
import torch

from portagrpo.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "standins"))
from fake_vllm import FakeLLM, play_in_test  # noqa: E402

RUN = ["trainer.progress_bar=false", "trainer.plot=false", "trainer.tensorboard=false", "trainer.test_freq=0",
       "trainer.save_freq=0", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=16",
       "actor.micro_batch_size=8", "data.train_size=32", "data.max_response_length=8", "model.tiny.moe=qwen3_moe",
       "actor.router_replay=R3", "rollout.engine=vllm", "rollout.vllm_weight_bucket_mb=0", "trainer.num_threads=1",
       "reward.num_workers=0"]


@pytest.fixture()
def standin(monkeypatch):
    threads = torch.get_num_threads()
    yield lambda platform: play_in_test(monkeypatch, platform)
    torch.set_num_threads(threads)


def _trainer(tmp_path, *extra: str):
    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    return Trainer(load_config(None, [*RUN, *extra]), run_dir=tmp_path / "run", log=lambda m: None)


def _two_steps(trainer) -> list[dict]:
    trainer.setup()
    try:
        return [trainer.step().metrics.row() for _ in range(2)]
    finally:
        trainer.close()


def test_r3_replays_the_experts_vllm_routed_each_token_to(standin, tmp_path):
    standin("cuda")
    trainer = _trainer(tmp_path).setup()
    try:
        rows = [trainer.step().metrics.row() for _ in range(2)]
    finally:
        trainer.close()
    llm = FakeLLM.instances[-1]
    assert llm.kwargs.get("enable_return_routed_experts") is True
    for row in rows:  # one mini-batch: the update's forward routes with the weights vLLM sampled with
        assert row["moe/route_agreement"] >= 0.99, row["moe/route_agreement"]


def test_without_replay_the_route_agreement_is_logged_where_the_build_returns_routes(standin, tmp_path):
    """Router replay off: a build that returns its routes gives moe/route_agreement (the trainer's live routes against
    vLLM's, nothing replayed); the CPU build cannot, and the run trains without the metric instead of stopping."""
    standin("cuda")
    rows = _two_steps(_trainer(tmp_path / "gpu", "actor.router_replay=null"))
    assert FakeLLM.instances[-1].kwargs.get("enable_return_routed_experts") is True
    assert all(row["moe/route_agreement"] >= 0.99 for row in rows)
    standin("cpu")
    rows = _two_steps(_trainer(tmp_path / "cpu", "actor.router_replay=null"))
    assert "enable_return_routed_experts" not in FakeLLM.instances[-1].kwargs  # built again without asking
    assert all("moe/route_agreement" not in row for row in rows) and len(rows) == 2


def test_a_vllm_build_that_cannot_return_routes_refuses_r3_in_one_sentence(standin, tmp_path):
    standin("cpu")
    trainer = _trainer(tmp_path)
    with pytest.raises(UserError, match=r"router_replay=R3 needs vLLM to return .*this vLLM build refused "
                                        r"\(AuxOutput Connector requires Model Runner V2"):
        trainer.setup()
    trainer.close()
