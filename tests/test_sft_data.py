"""The SFT data layer on its own: templates, loss masks, truncation, chat turns, mixing."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher_scripts.errors import ConfigError
from launcher_scripts.jobs.fine_tuning import sft_data
from launcher_scripts.jobs.fine_tuning.sft_data import SftFormat
from launcher_scripts.recipes.tuning import read_spec

EOD = 0


class Chars:
    """One id per character (1-based), so lengths and positions are easy to read."""

    eod_id = EOD

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids if i != EOD)


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def load(path: Path, fmt: SftFormat) -> tuple[list[sft_data.Record], str | None]:
    files, report = sft_data.load_files([path], Chars(), fmt, "training data")
    return files[0].records, report


def test_prompt_and_answer_split_at_the_label(tmp_path: Path) -> None:
    fmt = SftFormat(prompt_template="Q: {input} A: {output}")
    [record], report = load(write(tmp_path / "a.jsonl", [{"input": "x", "output": "yz"}]), fmt)
    assert report is None
    assert record.prompt == "Q: x A:" and record.answer == " yz" and record.answers == ["yz"]
    ids, loss = record.encoded.ids, record.encoded.loss
    assert Chars().decode(ids) == "Q: x A: yz" and ids[-1] == EOD
    # answer_only_loss: the answer's three tokens (space, y, z) and EOD, nothing of the prompt
    assert loss == [0] * len("Q: x A:") + [1, 1, 1, 1]


def test_loss_on_the_prompt_too_and_no_eos(tmp_path: Path) -> None:
    fmt = SftFormat(prompt_template="{input}{output}", answer_only_loss=False, add_eos=False)
    [record], _ = load(write(tmp_path / "a.jsonl", [{"input": "ab", "output": "c"}]), fmt)
    assert record.encoded.ids == [97, 98, 99] and record.encoded.loss == [1, 1, 1]


def test_over_long_prompt_loses_its_end_and_is_reported(tmp_path: Path) -> None:
    fmt = SftFormat(prompt_template="{input} {output}", max_seq_length=8)
    rows = [{"input": "abcdefghij", "output": "xy"}, {"input": "a", "output": "b"}]
    records, report = load(write(tmp_path / "a.jsonl", rows), fmt)
    assert Chars().decode(records[0].encoded.ids) == "abcd xy"  # 4 + " xy" + EOD = 8
    assert len(records[0].encoded.ids) == 8 and len(records) == 2
    assert report is not None and "1 truncated (end of the prompt)" in report
    assert f"{tmp_path / 'a.jsonl'}:1" in report


def test_an_answer_that_cannot_fit_is_dropped_and_counted(tmp_path: Path) -> None:
    fmt = SftFormat(prompt_template="{input} {output}", max_seq_length=4)
    rows = [{"input": "a", "output": "long answer"}, {"input": "a", "output": "b"}]
    records, report = load(write(tmp_path / "a.jsonl", rows), fmt)
    assert [r.answer for r in records] == [" b"]
    assert report is not None and "1 dropped: the answer alone exceeds the limit" in report


def test_truncating_the_answer_when_asked(tmp_path: Path) -> None:
    fmt = SftFormat(prompt_template="{input} {output}", max_seq_length=6, truncation_field="answer")
    [record], report = load(write(tmp_path / "a.jsonl", [{"input": "ab", "output": "cdef"}]), fmt)
    # Cut from the end, EOD first: a cut answer does not teach the model to stop there.
    assert record.encoded.ids == Chars().encode("ab cde")
    assert report is not None and "end of the answer" in report


def test_chat_turns_of_the_masked_role_carry_no_loss(tmp_path: Path) -> None:
    chat = {
        "system": "S",
        "conversations": [{"from": "User", "value": "hi"}, {"from": "Bot", "value": "yo"}],
        "mask": "User",
    }
    [record], _ = load(write(tmp_path / "c.jsonl", [chat]), SftFormat())
    text = Chars().decode(record.encoded.ids)
    assert text == "S\nUser: hi\nBot: yo"
    learned = "".join(
        chr(i) for i, m in zip(record.encoded.ids, record.encoded.loss, strict=True) if m and i
    )
    assert learned == "yo"
    assert record.encoded.loss[-1] == 1  # the closing EOD ends the learned turn


def test_bad_lines_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input": "a", "output": "b"}\nnot json\n')
    with pytest.raises(sft_data.SftDataError, match=rf"{path}:2: not JSON"):
        load(path, SftFormat())
    write(path, [{"input": "a"}])
    with pytest.raises(sft_data.SftDataError, match=r":1: no 'output' key"):
        load(path, SftFormat())


def test_template_without_the_label_is_refused() -> None:
    with pytest.raises(ConfigError, match="prompt_template"):
        SftFormat(prompt_template="{input} answer").check("peft.model.data.train_ds")


def test_tensors_shift_by_one_and_pad_without_loss() -> None:
    encoded = sft_data.Encoded([5, 6, 7, EOD], [0, 0, 1, 1], 2)
    item = sft_data.to_tensors(encoded, 6, EOD)
    assert item["tokens"].tolist() == [5, 6, 7, EOD, EOD, EOD]
    assert item["labels"].tolist() == [6, 7, EOD, EOD, EOD, EOD]
    assert item["loss_mask"].tolist() == [0, 1, 1, 0, 0, 0]


def test_mixing_follows_the_weights_and_walks_each_file(tmp_path: Path) -> None:
    fmt = SftFormat()
    files = []
    for name, count in (("a", 3), ("b", 5)):
        rows = [{"input": f"{name}{i}", "output": "x"} for i in range(count)]
        files += sft_data.load_files([write(tmp_path / f"{name}.jsonl", rows)], Chars(), fmt, "t")[
            0
        ]
    mixed = sft_data.MixedSamples(files, (0.25, 0.75), 400, 16, EOD, seed=1, shuffle=True)
    sources = Counter(source for source, _ in mixed.choice)
    assert sources == {0: 100, 1: 300}
    # Every record of a file appears once per epoch of that file.
    firsts = [mixed.choice.index((0, n)) for n in range(3)]
    seen = {Chars().decode(mixed[i]["tokens"].tolist()[:2]) for i in firsts}
    assert seen == {"a0", "a1", "a2"}
    again = sft_data.MixedSamples(files, (0.25, 0.75), 400, 16, EOD, seed=1, shuffle=True)
    assert all(mixed[i]["tokens"].equal(again[i]["tokens"]) for i in range(0, 400, 37))


def test_evaluation_pads_to_whole_batches_without_loss(tmp_path: Path) -> None:
    rows = [{"input": str(i), "output": "x"} for i in range(5)]
    files, _ = sft_data.load_files([write(tmp_path / "v.jsonl", rows)], Chars(), SftFormat(), "v")
    samples = sft_data.EvalSamples(files, 4, 8, EOD)
    assert len(samples) == 8 and samples.batches == 2
    assert samples[4]["loss_mask"].sum() > 0 and samples[5]["loss_mask"].sum() == 0


def recipe(**data: object) -> object:
    section = {"file_names": ["/d/a.jsonl"], "max_seq_length": 64} | data
    return OmegaConf.create(
        {
            "exp_manager": {"explicit_log_dir": "/r", "name": "x"},
            "model": {
                "restore_from_path": "/m.nemo",
                "peft": {"peft_scheme": "lora", "lora_tuning": {"adapter_dim": 4}},
                "data": {"train_ds": section},
            },
        }
    )


def test_weights_must_match_the_files() -> None:
    cfg = recipe(file_names=["/a.jsonl", "/b.jsonl"], concat_sampling_probabilities=[1.0])
    with pytest.raises(
        ConfigError, match=r"peft.model.data.train_ds.concat_sampling_probabilities"
    ):
        read_spec(cfg, "peft")
    cfg = recipe(file_names=["/a.jsonl", "/b.jsonl"], concat_sampling_probabilities=[0.5, 0.6])
    with pytest.raises(ConfigError, match="sum to 1"):
        read_spec(cfg, "peft")


def test_unknown_lora_target_is_refused() -> None:
    cfg = recipe()
    cfg.model.peft.lora_tuning.target_modules = ["attention_qkv", "mlp_up"]
    with pytest.raises(ConfigError, match="target_modules"):
        read_spec(cfg, "peft")


def test_packing_restarts_positions_and_isolates_samples(tmp_path: Path) -> None:
    from launcher_scripts.jobs.fine_tuning.packing import PackedSamples

    rows = [{"input": "ab", "output": "c"}, {"input": "de", "output": "fg"}]
    files, _ = sft_data.load_files([write(tmp_path / "t.jsonl", rows)], Chars(), SftFormat(), "t")
    stream = sft_data.MixedSamples(files, (1.0,), 4, 12, EOD, seed=0, shuffle=False)
    packed = PackedSamples(stream, 2, 12, EOD)
    item = packed[0]
    # "ab c" + EOD (4 positions) then "de fg" + EOD (5 positions): both fit in 12.
    assert Chars().decode(item["tokens"][:9].tolist()) == "ab cde fg"
    assert item["position_ids"][:9].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert item["loss_mask"].tolist() == [0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0]
    mask = item["attention_mask"][0]
    assert not mask[5, 4] and mask[5, 3]  # the second sample sees itself, not the first
    assert mask[0, 1] and not mask[1, 0]  # causal
    assert packed._span(1) == (2, 4)  # the next pack starts where this one ended
