"""geo3k (verl's vision-language example): `portagrpo data geo3k`, loading rows with images, and the reward."""
import base64
import io
import json

import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from portagrpo.config.load import load_config  # noqa: E402
from portagrpo.data.prepare import GEO3K_SOURCE, convert  # noqa: E402
from portagrpo.data.records import DataError, load_records  # noqa: E402
from portagrpo.rewards.functions import RewardResolver  # noqa: E402
from portagrpo.rewards.geo3k import geo3k_reward  # noqa: E402


def _png(size=(28, 28), color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _hf_rows():
    """Rows in hiyouga/geometry3k's layout: a figure, the problem with its placeholder, the answer."""
    return [{"images": [{"bytes": _png(color=(i * 40, 0, 0)), "path": f"fig{i}.png"}],
             "problem": f"<image>Find x if the angle is {i}0 degrees.", "answer": str(i * 3)} for i in range(1, 4)]


def _snapshot(folder):
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_geo3k_conversion_round_trip_keeps_the_images_encoded(tmp_path):
    src = _write_parquet(tmp_path / "train.parquet", _hf_rows())
    out, n, problems = convert("geo3k", src, tmp_path / "out")
    assert (out.name, n, problems) == ("train.parquet", 3, [])
    import pyarrow.parquet as pq

    schema = pq.read_schema(out)
    assert str(schema.field("images").type) == "list<element: struct<bytes: binary, path: string>>"
    row = pq.read_table(out).to_pylist()[0]
    assert row["data_source"] == GEO3K_SOURCE == "hiyouga/geometry3k"
    assert row["reward_model"] == {"style": "rule", "ground_truth": "3"}
    content = row["prompt"][0]["content"]
    assert row["prompt"][0]["role"] == "user" and content.startswith("<image>Find x")
    assert "<think>" in content and "\\boxed{}" in content
    assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == 0
    records = load_records([str(out)])
    assert [r.images for r in records] == [(r["images"][0]["bytes"],) for r in _hf_rows()]
    assert all(isinstance(r.images[0], bytes) for r in records)  # kept encoded, not decoded to pixels
    assert [r.ground_truth for r in records] == ["3", "6", "9"] and records[0].data_source == GEO3K_SOURCE
    RewardResolver("auto").check_sources({r.data_source for r in records})  # auto has a reward for it


def test_geo3k_jsonl_with_image_paths_converts_and_its_jsonl_output_loads(tmp_path):
    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / "a.png").write_bytes(_png(color=(1, 2, 3)))
    line = {"images": ["figs/a.png"], "problem": "<image>Find y.", "answer": "2\\sqrt{3}"}
    src = tmp_path / "test.jsonl"
    src.write_text(json.dumps(line) + "\n")
    out, n, _ = convert("geo3k", src, tmp_path / "out", fmt="jsonl")
    assert n == 1
    written = json.loads(out.read_text())
    assert base64.b64decode(written["images"][0]["bytes"]) == _png(color=(1, 2, 3))
    (rec,) = load_records([str(out)])
    assert rec.images == (_png(color=(1, 2, 3)),) and rec.ground_truth == "2\\sqrt{3}"


def _verl_row(images, content="<image>Find x. Reason, then answer in \\boxed{}."):
    return {"prompt": [{"role": "user", "content": content}], "images": images, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "5"}, "data_source": GEO3K_SOURCE,
            "extra_info": {"index": 0}}


def _truncated_png() -> bytes:
    data = _png(size=(64, 64))
    return data[: len(data) // 2]


BAD_ROWS = {
    "missing": (_verl_row([{"bytes": None, "path": "nowhere.png"}]), "image 1 is missing"),
    "null": (_verl_row([None]), "image 1 is missing"),
    "corrupt": (_verl_row([{"bytes": b"not an image at all", "path": None}]), "image 1 is not a decodable image"),
    "truncated": (_verl_row([{"bytes": _truncated_png(), "path": None}]), "image 1 is not a decodable image"),
    "oversized": (_verl_row([{"bytes": _png(size=(40, 40)), "path": None}]), "over data.max_image_pixels=1000"),
    "too_few": (_verl_row([{"bytes": _png(), "path": None}], "<image><image>Compare."), "2 <image> placeholder"),
    "too_many": (_verl_row([{"bytes": _png(), "path": None}] * 2), "but 2 image(s)"),
    "no_images": (_verl_row(None), "but 0 image(s)"),
}


@pytest.mark.parametrize("kind", sorted(BAD_ROWS))
def test_a_bad_image_row_gets_one_sentence_naming_file_and_row_and_changes_nothing(tmp_path, kind):
    bad, words = BAD_ROWS[kind]
    good = _verl_row([{"bytes": _png(), "path": None}])
    data = _write_parquet(tmp_path / "geo3k.parquet", [good, bad])
    before = _snapshot(tmp_path)
    with pytest.raises(DataError) as err:
        load_records([str(data)], max_image_pixels=1000 if kind == "oversized" else 12845056)
    message = str(err.value)
    assert message.startswith(f"{data} row 2 ") and words in message
    assert "\n" not in message and message.endswith(".") and message.count(". ") == 0
    assert _snapshot(tmp_path) == before


def test_an_image_within_the_limit_and_a_text_only_row_load(tmp_path):
    rows = [_verl_row([{"bytes": _png(size=(40, 25)), "path": None}]),
            {**_verl_row(None, "no figure here"), "images": []}]
    recs = load_records([str(_write_parquet(tmp_path / "d.parquet", rows))], max_image_pixels=1000)
    assert [len(r.images) for r in recs] == [1, 0]


def test_data_image_key_names_the_column_and_is_verls_key(tmp_path):
    row = _verl_row(None)
    row["pictures"] = [{"bytes": _png(), "path": None}]
    data = _write_parquet(tmp_path / "d.parquet", [row])
    (rec,) = load_records([str(data)], image_key="pictures")
    assert rec.images == (_png(),)
    notices: list[str] = []
    cfg = load_config(None, ["data.image_key=pictures", "data.max_image_pixels=4096"], check_files=False,
                      notices=notices)
    assert (cfg.data.image_key, cfg.data.max_image_pixels) == ("pictures", 4096)
    assert load_config(None, [], check_files=False).data.image_key == "images"


def test_convert_reports_bad_geo3k_rows_and_fail_writes_nothing(tmp_path):
    rows = _hf_rows()
    rows[1]["images"] = [{"bytes": b"garbage", "path": None}]
    rows[2]["problem"] = "Find x."  # no placeholder for its figure
    src = _write_parquet(tmp_path / "train.parquet", rows)
    out, n, problems = convert("geo3k", src, tmp_path / "out", log=lambda _: None)
    assert n == 1 and len(problems) == 2
    assert problems[0].startswith(f"{src} row 2: image 1 is not a decodable image")
    assert problems[1].startswith(f"{src} row 3: has 0 <image> placeholder(s)")
    with pytest.raises(DataError, match="row 2: image 1 is not a decodable image"):
        convert("geo3k", src, tmp_path / "out2", on_error="fail")
    assert not (tmp_path / "out2" / "train.parquet").exists()


@pytest.mark.parametrize("response, truth, score, correct", [
    ("<think>The angles sum to 180.</think> So x = \\boxed{60}.", "60", 1.0, True),
    ("<think>...</think> \\boxed{x = 60^{\\circ}}", "60", 1.0, True),
    ("<think>ratio</think> The side is \\boxed{\\frac{40}{3}}", "\\frac{40}{3}", 1.0, True),
    ("<think>...</think> \\boxed{4\\sqrt{3}}", "4 \\sqrt { 3 }", 1.0, True),
    ("<think>The angles sum to 180.</think> So x = \\boxed{61}.", "60", 0.1, False),  # wrong answer, right format
    ("So x = \\boxed{60}.", "60", 0.9, True),  # right answer, no <think>
    (" <think>a</think> \\boxed{60}", "60", 0.9, True),  # the format starts the response
    ("<think>a</think> x = 60", "60", 0.0, False),  # no box: neither
    ("<think>a \\boxed{60}</think> done", "60", 0.9, True),  # the box must come after </think>
    ("The answer is 60.", "60", 0.0, False),
])
def test_geo3k_reward_weights_answer_and_format_as_verl(response, truth, score, correct):
    out = geo3k_reward(GEO3K_SOURCE, response, truth)
    assert out["score"] == pytest.approx(score, abs=1e-12) and out["correct"] is correct
    assert RewardResolver("auto")(GEO3K_SOURCE)(GEO3K_SOURCE, response, truth) == out


def test_portagrpo_data_geo3k_command(tmp_path, capsys):
    from portagrpo.cli import main

    src = _write_parquet(tmp_path / "geo.parquet", _hf_rows())
    assert main(["data", "geo3k", "--input", str(src), "--output", str(tmp_path / "out"), "--split", "train"]) == 0
    assert "wrote 3 rows" in capsys.readouterr().out
    assert len(load_records([str(tmp_path / "out" / "train.parquet")])) == 3
