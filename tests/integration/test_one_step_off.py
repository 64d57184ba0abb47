"""rollout.mode=one_step_off: a sampler process of its own samples batch k+1 with the weights before
update k while the trainer updates on batch k; staleness is exactly one update, logged; checkpoints
save the batch in flight, so a resumed run continues exactly."""
import pytest
import torch

from portagrpo.config import ConfigError, load_config
from portagrpo.metrics import MEASURED_KEYS
from portagrpo.rollout.engines import group_prompts
from portagrpo.train.experience import seed_for

FAST = ["trainer.progress_bar=false", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=4", "data.train_size=32", "trainer.test_freq=0", "trainer.save_freq=0",
        "data.max_response_length=8", "actor.warmup_steps=0", "actor.lr=1e-2", "trainer.plot=false",
        "trainer.tensorboard=false"]


def _trainer(run_dir, *overrides, resume=None):
    from portagrpo.train import Trainer

    return Trainer(load_config(None, [*FAST, *overrides]), run_dir=run_dir, resume=resume,
                   log=lambda m: None).setup()


def _responses(out):
    rb = out.experience.batch.rollout
    return rb.responses * rb.response_mask.long()


def test_each_batch_is_sampled_with_the_weights_before_the_previous_update(tmp_path):
    """Batch 3 of an overlapped run equals what the policy after ONE update samples with batch 3's
    seed: the sampler process got the weights of update 1 and not those of update 2."""
    ahead = _trainer(tmp_path / "off", "rollout.mode=one_step_off")
    try:
        outs = [ahead.step() for _ in range(3)]
        assert ahead.parts.sampler.process.is_alive()
    finally:
        ahead.close()
    assert not ahead.parts.sampler.process.is_alive()  # the process ends with the run
    assert [o.metrics["rollout_staleness"] for o in outs] == [0, 1, 1]
    assert all("rollout_corr/kl" in o.metrics for o in outs)  # the mismatch is measured every step

    sync = _trainer(tmp_path / "sync")
    try:
        first = sync.step()
        assert torch.equal(_responses(first), _responses(outs[0]))  # batch 1: both sampled by the initial policy
        assert first.metrics["loss_policy"] == pytest.approx(outs[0].metrics["loss_policy"], rel=1e-5)
        # the policy after update 1, asked for batch 3's prompts with batch 3's seed
        rb3 = outs[2].experience.batch.rollout
        by_index = {r.index: r for r in sync.parts.data.loader.records}
        records = [by_index[i] for i in rb3.prompt_index[::4].tolist()]
        exp = sync.pipeline
        group = group_prompts(exp.tokenizer, records, 4, exp.engine.pad_id, "cpu",
                              prompt_width=rb3.prompt_ids.shape[1])
        sync.runtime.backend.seed(seed_for(sync.cfg.trainer.seed, 3, 1))
        redo = exp.engine.generate(group.prompt_ids, group.prompt_mask, exp.settings.sampling)
        assert torch.equal(redo.responses * redo.mask.long(), _responses(outs[2]))
        sync.step()  # and the policy after update 2 samples something else for them
        sync.runtime.backend.seed(seed_for(sync.cfg.trainer.seed, 3, 1))
        later = exp.engine.generate(group.prompt_ids, group.prompt_mask, exp.settings.sampling)
        assert not torch.equal(later.responses * later.mask.long(), _responses(outs[2]))
    finally:
        sync.close()


def test_resume_continues_exactly_with_the_batch_in_flight(tmp_path):
    whole = _trainer(tmp_path / "whole", "rollout.mode=one_step_off", "trainer.save_freq=2", "trainer.total_steps=4")
    try:
        rows = whole.fit(progress=False)
    finally:
        whole.close()
    ckpt = tmp_path / "whole" / "checkpoints" / "step_00000002"
    saved = torch.load(ckpt / "inflight.pt", weights_only=False)
    assert saved["ranks"][0]["step"] == 3 and saved["ranks"][0]["version"] == 1  # sampled with update 1's weights
    again = _trainer(tmp_path / "whole", "rollout.mode=one_step_off", "trainer.save_freq=2", "trainer.total_steps=4",
                     resume=ckpt)
    try:
        assert again.step_done == 2
        resumed = again.fit(progress=False)
    finally:
        again.close()
    assert [r["step"] for r in resumed] == [3, 4]
    for before, after in zip(rows[2:], resumed):
        for key, value in before.items():
            if key not in MEASURED_KEYS:
                assert after[key] == value, (key, before["step"])


def test_refusals_are_one_sentence():
    with pytest.raises(ConfigError, match="rollout.mode=one_step_off runs the hf engine in a sampler process"):
        load_config(None, ["rollout.mode=one_step_off", "rollout.engine=fixed"])
    # DAPO's filter, tools and images one step off are built (tests/integration/test_rollout_matrix.py)
    load_config(None, ["rollout.mode=one_step_off", "algorithm.filter_groups.enable=true"])


def test_an_overlapped_checkpoint_resumed_in_sync_mode_trains_on_the_batch_in_flight(tmp_path):
    """The loader of an overlapped run has handed out the in-flight batch already; a sync resume must
    train step 3 on those prompts, not skip them."""
    run = tmp_path / "run"
    ahead = _trainer(run, "rollout.mode=one_step_off", "trainer.save_freq=2", "trainer.total_steps=3")
    try:
        ahead.fit(progress=False)
    finally:
        ahead.close()
    ckpt = run / "checkpoints" / "step_00000002"
    in_flight = torch.load(ckpt / "inflight.pt", weights_only=False)["ranks"][0]["prompts"]
    sync = _trainer(run, "trainer.save_freq=2", "trainer.total_steps=3", resume=ckpt)
    try:
        assert sync.parts.sampler is None
        out = sync.step()
    finally:
        sync.close()
    trained = out.experience.batch.rollout.prompt_index[::4].tolist()
    assert trained == [r.index for r in in_flight]


def test_the_copy_in_the_requested_precision_lives_in_the_sampler_process_only(tmp_path):
    t = _trainer(tmp_path, "rollout.mode=one_step_off", "rollout.precision=int8")
    try:
        assert not t.parts.engine.holds_weights  # validation samples with the training model itself
        assert t.step().metrics["rollout_corr/abs_logp_diff_mean"] > 0
    finally:
        t.close()
