"""Images are checked where they enter (`portagrpo data geo3k`, a run's loader, `portagrpo eval`): an image the
policy's processor cannot take, or would shrink unless data.max_image_pixels lets it, is refused in one sentence
naming its row, never a processor traceback; `--dry-run` refuses what the run refuses."""
import base64
import io
import json

import pytest

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from portagrpo.cli import main  # noqa: E402
from portagrpo.data import images  # noqa: E402
from portagrpo.data.records import DataError, load_records  # noqa: E402
from portagrpo.model import vision  # noqa: E402

TINY = ["model.tiny.vision=true", "model.tiny.num_heads=2"]
# the policy's processor: transformers too old for a vision-language policy (the oldest CI leg) has none
needs_vl = pytest.mark.skipif(vision.vision_support_problem() is not None, reason=str(vision.vision_support_problem()))


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def _jsonl(path, sizes):
    """One row per (width, height), each with one image and its `<image>` placeholder."""
    rows = [{"prompt": [{"role": "user", "content": "<image>What colour?"}],
             "images": [{"bytes": base64.b64encode(_png(w, h)).decode(), "path": None}],
             "reward_model": {"ground_truth": "red"}, "data_source": "colours"} for w, h in sizes]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def processor():
    return vision.build_tiny_processor()


@pytest.mark.parametrize("size", [(1000, 1), (1, 1000), (603, 3)])
def test_an_aspect_ratio_no_qwen2_vl_processor_takes_is_refused_at_load_naming_the_row(tmp_path, size):
    data = _jsonl(tmp_path / "d.jsonl", [(56, 56), size])
    with pytest.raises(DataError, match=rf"d.jsonl row 2 image 1 is {size[0]}x{size[1]}, an aspect ratio over the "
                                        r"200:1 Qwen2-VL-family processors take"):
        load_records([str(data)])


@needs_vl
def test_the_rule_is_transformers_own_smart_resize_on_every_side(processor):
    """Exactly the images the processor's own resize takes pass (sizes around the 200:1 limit, tiny and long)."""
    rule = images.processor_rule(processor)
    assert rule.resize is not None and rule.resize.__name__ == "smart_resize"
    assert (rule.factor, rule.min_pixels, rule.max_pixels) == (28, vision.TINY_MIN_PIXELS, vision.TINY_MAX_PIXELS)
    limits = images.ImageLimits(10 ** 9, "a test's cap", rule, allow_shrink=True)
    for w, h in [(1, 1), (1, 200), (1, 201), (200, 1), (201, 1), (5, 1000), (5, 1001), (28, 5600), (28, 5601),
                 (10, 10), (3000, 20), (112, 112), (113, 113)]:
        try:
            rule.resize(h, w, factor=rule.factor, min_pixels=rule.min_pixels, max_pixels=rule.max_pixels)
            takes = True
        except ValueError:
            takes = False
        assert (images.shape_problem(w, h, limits) is None) == takes, (w, h)


@needs_vl
def test_an_image_the_processor_would_shrink_is_refused_unless_the_config_lets_it_and_then_counted(
        tmp_path, processor):
    data = _jsonl(tmp_path / "d.jsonl", [(56, 56), (300, 200), (112, 112), (113, 113)])
    with pytest.raises(DataError, match=r"row 2 image 1 is 300x200 = 60000 pixels, over the model's limit of 12544 "
                                        r"\(its processor's max_pixels, which would shrink it; "
                                        r"data.max_image_pixels=60000 or more lets it\)"):
        load_records([str(data)], processor=processor)
    records = load_records([str(data)], processor=processor, max_image_pixels=60000)
    notice = images.shrink_notice(records, images.image_limits(60000, processor))
    assert notice == ("the processor shrinks 1 of 4 images, those over the model's limit of 12544 pixels (its "
                      "max_pixels), to within it (data.max_image_pixels=60000 lets them in)")
    assert images.shrink_notice(records[:1], images.image_limits(60000, processor)) is None
    with pytest.raises(DataError, match=r"row 2 image 1 is 300x200 = 60000 pixels, over data.max_image_pixels=59999"):
        load_records([str(data)], processor=processor, max_image_pixels=59999)


def test_portagrpo_data_geo3k_skips_or_refuses_such_an_image_naming_the_line(tmp_path, capsys):
    def item(width, height):
        return {"problem": "<image>Find x.", "answer": "3",
                "images": [{"bytes": base64.b64encode(_png(width, height)).decode(), "path": None}]}

    src = tmp_path / "geo.jsonl"
    src.write_text(json.dumps(item(56, 56)) + "\n" + json.dumps(item(1000, 1)) + "\n")
    assert main(["data", "geo3k", "--input", str(src), "--output", str(tmp_path / "out"), "--split", "train"]) == 0
    out = capsys.readouterr().out
    assert f"skipped {src}:2: image 1 is 1000x1, an aspect ratio over the 200:1" in out
    assert "wrote 1 rows" in out
    assert main(["data", "geo3k", "--input", str(src), "--output", str(tmp_path / "out2"), "--split", "train",
                 "--on-error", "fail"]) == 2
    err = capsys.readouterr().err
    assert err.count("portagrpo: error:") == 1 and f"{src}:2: image 1 is 1000x1" in err and "Traceback" not in err


@needs_vl
@pytest.mark.parametrize("sizes, expected", [
    ([(56, 56), (56, 56), (1000, 1), (56, 56)], "row 3 image 1 is 1000x1, an aspect ratio over the 200:1"),
    ([(56, 56), (56, 56), (300, 200), (56, 56)], "row 3 image 1 is 300x200 = 60000 pixels, over the model's limit"),
])
def test_a_training_run_refuses_it_in_one_sentence(tmp_path, capsys, sizes, expected):
    data = _jsonl(tmp_path / "d.jsonl", sizes)
    code = main(["train", "--output-dir", str(tmp_path / "run"), *TINY, "data.task=null",
                 f"data.train_files=[{data}]", "data.train_batch_size=2", "rollout.n=2",
                 "actor.ppo_mini_batch_size=4", "trainer.progress_bar=false"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("portagrpo: error:") == 1 and expected in err and "Traceback" not in err


@needs_vl
def test_eval_refuses_it_in_one_sentence_and_says_what_it_shrinks(tmp_path, capsys, processor):
    from portagrpo.config import load_config

    model_dir = tmp_path / "vl"
    vision.build_tiny_vl_model(load_config(None, TINY).model.tiny, processor.tokenizer, 0).save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    bad = _jsonl(tmp_path / "bad.jsonl", [(56, 56), (1, 1000)])
    big = _jsonl(tmp_path / "big.jsonl", [(56, 56), (300, 200)])
    base = ["eval", "--model", str(model_dir), "--max-new-tokens", "2", "--device", "cpu", "--reward", "colours"]
    for data, expected in [(bad, "bad.jsonl row 2 image 1 is 1x1000, an aspect ratio over"),
                           (big, "big.jsonl row 2 image 1 is 300x200 = 60000 pixels, over the model's limit of "
                                 "12544 (its processor's max_pixels, which would shrink it; --max-image-pixels=60000 "
                                 "or more lets it)")]:
        assert main([*base, "--data", str(data), "--output", str(tmp_path / "e.json")]) == 2
        err = capsys.readouterr().err
        assert err.count("portagrpo: error:") == 1 and expected in err and "Traceback" not in err
    assert main([*base, "--data", str(big), "--max-image-pixels", "0"]) == 2
    assert "--max-image-pixels=0 must be at least 1" in capsys.readouterr().err
    assert main([*base, "--data", str(big), "--max-image-pixels", "60000", "--output", str(tmp_path / "e.json")]) == 0
    assert "the processor shrinks 1 of 2 images" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, expected", [
    (["data.max_image_pixels=0"], "data.max_image_pixels=0 must be at least 1"),
    (["data.max_image_pixels=-5"], "data.max_image_pixels=-5 must be at least 1"),
    # images compose with one_step_off, tools and DAPO's filter (tests/integration/test_rollout_matrix.py)
])
def test_dry_run_refuses_what_the_run_refuses_in_the_same_sentence(tmp_path, capsys, monkeypatch, overrides,
                                                                     expected):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    sentences = []
    for dry in (["--dry-run"], ["--output-dir", str(tmp_path / "run")]):
        assert main(["train", *dry, *overrides]) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err
        sentences.append(err)
    assert sentences[0] == sentences[1]
    assert not (tmp_path / "run").exists()
