"""A vision-language policy on a transformers too old for it is refused in one sentence, never an ImportError or a
silently different model (the oldest supported stack, transformers 4.57, runs text policies only)."""
import pytest
import transformers

from portagrpo.model import vision


@pytest.mark.parametrize("version", ["4.57.1", "5.5.3"])
def test_an_old_transformers_refuses_a_vision_language_policy_in_one_sentence(monkeypatch, version, tmp_path):
    monkeypatch.setattr(vision, "transformers_version", lambda: version)
    expected = f"needs transformers {vision.VL_MIN_TRANSFORMERS} or newer and this environment has {version}"
    for build in (vision.build_tiny_processor, lambda: vision.load_processor(tmp_path)):
        with pytest.raises(vision.VisionError, match=expected):
            build()
    with pytest.raises(vision.VisionError, match="install transformers>=5.5.4"):
        vision.build_tiny_vl_model(None, None, 0)


def test_this_environment_is_told_the_truth():
    """On the oldest stack (CI's first leg) the gate is what a user meets; on a newer one it stays out of the way."""
    from packaging.version import Version

    old = Version(transformers.__version__) < Version(vision.VL_MIN_TRANSFORMERS)
    assert (vision.vision_support_problem() is not None) == old
    if old:
        with pytest.raises(vision.VisionError, match="or newer and this environment has"):
            vision.build_tiny_processor()
