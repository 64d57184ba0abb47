"""`portagrpo bench step`: phases, floors and ratios come out of real subprocess runs."""
import json

import pytest

from portagrpo.cli import main
from portagrpo.errors import UserError
from portagrpo.tools.bench_step import PHASES, parse_variants, phase_flops

TINY = ["data.train_batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4",
        "data.max_response_length=6", "data.train_size=16", "data.val_size=4"]


def test_bench_step_reports_every_phase_against_its_floor(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "step", "--steps", "2", "--warmup", "1", "--json", str(out), "--variant", "base=",
                 "--variant", "kl_off=actor.use_kl_loss=false", *TINY])
    assert code == 0
    report = json.loads(out.read_text())
    base, kl_off = report["results"]
    assert [r["variant"] for r in report["results"]] == ["base", "kl_off"] and base["threads"] == 1
    for r in (base, kl_off):
        assert set(r["phases_s"]) == set(PHASES) and all(v >= 0 for v in r["phases_s"].values())
        assert sum(r["phases_s"].values()) <= r["time_step_s"] * 1.001  # the phases partition the step
        for phase in ("generate", "update"):
            assert r["floor_s"][phase] > 0 and r["x_floor"][phase] > 0
        assert r["tokens_per_s_per_device"] > r["response_tokens_per_s"] > 0
    # one update over the whole batch with no reference: no scoring pass at all, so no log-prob FLOPs
    assert base["floor_s"]["logprobs"] > 0 and kl_off["floor_s"]["logprobs"] == 0
    assert "kl_off: step time" in capsys.readouterr().out


def test_phase_flops_and_variant_parsing():
    f = phase_flops(1000, prompt_tokens=30, response_tokens=10, scoring_passes=2, ppo_epochs=1)
    assert f == {"generate": 80000.0, "reward": 0.0, "logprobs": 160000.0, "update": 240000.0}
    assert parse_variants([]) == [("default", [])]
    assert parse_variants(["a=x=1,y=2", "b="]) == [("a", ["x=1", "y=2"]), ("b", [])]
    with pytest.raises(UserError, match="must look like NAME=key=value"):
        parse_variants(["nothing"])
