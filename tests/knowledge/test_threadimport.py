"""`assistant kb import-thread`: a plain-text forum thread becomes a thread file.

The seed thread (shared/seeds/000_0d95b9825ebdd6ac.txt) was tagged by hand in
kb/threads/seed-000-ddp-cant-find-device.yaml; importing the text again must
find the same 8 author voices, the same advice, every contradiction the file
names, and most of the same claims, with that hand-tagged thread left out of
the index (otherwise retrieval would find the answers' own tags).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from assistant.cli import main
from assistant.knowledge.engine import Engine
from assistant.knowledge.kb import load_kb
from assistant.knowledge.threadimport import draft_thread, parse_thread, propose_advice, slug

REPO = Path(__file__).resolve().parents[2]
SEED_THREAD = REPO / "kb/threads/seed-000-ddp-cant-find-device.yaml"
SEED_TEXT_COPY = Path("/work/shared/seeds/000_0d95b9825ebdd6ac.txt")
# Measured with the seed thread left out of the index: claims P 0.67, R 0.52, F1 0.58
# (all 48 KB threads, each held out: P 0.59, R 0.67, F1 0.63). Retrieval changes move it.
CLAIMS_F1_FLOOR = 0.5


def seed_text() -> str:
    """The forum text, rebuilt from the thread file's verbatim question and answers
    when the shared seed file is not on this machine."""
    if SEED_TEXT_COPY.is_file():
        return SEED_TEXT_COPY.read_text("utf-8")
    seed = yaml.safe_load(SEED_THREAD.read_text("utf-8"))
    return "\n\n".join([seed["question"], *(a["text"] for a in seed["answers"])])


def seed_answers() -> list[dict]:
    return yaml.safe_load(SEED_THREAD.read_text("utf-8"))["answers"]


def squash(text: str) -> str:
    return "".join(text.split())


def test_seed_splits_into_its_eight_voices():
    parsed = parse_thread(seed_text())
    assert parsed.question == "用PyTorch做多卡训练，DDP一直报错找不到设备，求指点"
    assert [squash(a) for a in parsed.answers] == [squash(a["text"]) for a in seed_answers()]
    assert parsed.answers[6].count("\n\n") == 3  # a7: four paragraphs, one voice


def test_author_lines_separate_answers_and_keep_paragraphs():
    text = (
        "DDP hangs at the first all_reduce on two RTX 4090s\n\n"
        "alice wrote:\nSet NCCL_P2P_DISABLE=1.\n\nThe 4090 has no P2P.\n\n"
        "bob replied:\nUpdate the driver.\n\n"
        "--- carol ---\nAlso check the BIOS IOMMU setting.\n"
    )
    parsed = parse_thread(text)
    assert parsed.question == "DDP hangs at the first all_reduce on two RTX 4090s"
    assert parsed.answers == [
        "Set NCCL_P2P_DISABLE=1.\n\nThe 4090 has no P2P.",
        "Update the driver.",
        "Also check the BIOS IOMMU setting.",
    ]


def test_english_continuations_join_their_answer():
    parsed = parse_thread("Q?\n\nUse torchrun.\n\nAlso, read LOCAL_RANK.\n\nIt is the sampler.")
    assert parsed.answers == ["Use torchrun.\n\nAlso, read LOCAL_RANK.", "It is the sampler."]


@pytest.mark.parametrize(
    ("text", "advice"),
    [
        ("把set_device放到init_process_group后面试试", "set-device-after-init"),
        ("init_process_group 之前最好先 torch.cuda.set_device", "set-device-before-init"),
        (
            "我之前先设了set_device再初始化进程组，改成先初始化再设设备就通了",
            "set-device-after-init",
        ),
        ("试试直接删掉set_device那行", "remove-set-device"),
        (
            "Call torch.cuda.set_device(local_rank) before init_process_group.",
            "set-device-before-init",
        ),
        ("Move init_process_group before set_device and it works.", "set-device-after-init"),
        ("You don't need set_device at all, remove the set_device call.", "remove-set-device"),
        ("先设环境变量再调set_device，顺序换一下", ""),
        ("Use the gloo backend to narrow it down.", ""),
        (
            'Call torch.cuda.set_device(int(os.environ["LOCAL_RANK"])) before init_process_group',
            "set-device-before-init",
        ),
        ("把 device_ids 和 output_device 两个参数删掉就不报错了", ""),
    ],
)
def test_advice_from_the_wording(text, advice):
    assert propose_advice(text) == advice


def test_slug_of_a_file_name():
    assert slug("000_0d95b9825ebdd6ac") == "000-0d95b9825ebdd6ac"
    assert slug("___") == "thread"


@pytest.fixture(scope="module")
def engine_without_seed(engine, build_dir, tmp_path_factory):
    """The real engine over the KB minus the hand-tagged seed thread (index copied,
    so only the change is rebuilt)."""
    root = tmp_path_factory.mktemp("heldout")
    kb = root / "kb"
    shutil.copytree(REPO / "kb", kb)
    (kb / "threads" / SEED_THREAD.name).unlink()
    shutil.copytree(build_dir, root / "build")
    held_out = Engine(
        kb_root=kb,
        index_path=root / "build" / "index.sqlite",
        log=lambda message: None,
        embedder=engine.embedder,
    )
    held_out.load()
    shown = held_out.ask("DDP一直报错找不到设备", top=10).causes
    assert not any(a.thread == "seed-000-ddp-cant-find-device" for c in shown for a in c.answers)
    return held_out


@pytest.fixture(scope="module")
def seed_import(engine_without_seed):
    return draft_thread(seed_text(), "seed-reimport", engine_without_seed)


def test_seed_import_agrees_on_advice(seed_import):
    assert [a.advice for a in seed_import.answers] == [a.get("advice", "") for a in seed_answers()]


def test_seed_import_finds_every_contradiction_of_the_seed(seed_import):
    def pairs(answers):
        return {frozenset((a["id"], o)) for a in answers for o in a.get("contradicts", [])}

    seed = pairs(seed_answers())
    proposed = pairs([{"id": a.id, "contradicts": a.contradicts} for a in seed_import.answers])
    assert seed <= proposed  # all 6 of the seed's pairs
    advice = {a.id: a.advice for a in seed_import.answers}
    assert all(len({advice[x] for x in pair}) == 2 for pair in proposed)
    assert len(proposed) == 11  # every pair of differing advice; the seed names 6 of them


def test_seed_import_agrees_on_most_claims(seed_import):
    true_pos = false_pos = false_neg = 0
    for mine, theirs in zip(seed_import.answers, seed_answers(), strict=True):
        proposed = {c.cause_id for c in mine.claims}
        tagged = set(theirs["claims"])
        true_pos += len(proposed & tagged)
        false_pos += len(proposed - tagged)
        false_neg += len(tagged - proposed)
        assert all(0 < c.confidence <= 1 for c in mine.claims)
    precision = true_pos / (true_pos + false_pos)
    recall = true_pos / (true_pos + false_neg)
    f1 = 2 * precision * recall / (precision + recall)
    assert f1 >= CLAIMS_F1_FLOOR, f"claims P={precision:.2f} R={recall:.2f} F1={f1:.2f}"


def test_imported_file_is_a_valid_unverified_thread(seed_import, tmp_path):
    path = tmp_path / "threads" / "seed-reimport.yaml"
    path.parent.mkdir()
    path.write_text(seed_import.yaml, encoding="utf-8")
    kb = load_kb([REPO / "kb", tmp_path])
    thread = next(t for t in kb.threads if t.id == "seed-reimport")
    assert thread.lang == "zh" and len(thread.answers) == 8
    for loaded, drafted in zip(thread.answers, seed_import.answers, strict=True):
        assert loaded.stance == "unverified"
        assert loaded.claims == [c.cause_id for c in drafted.claims]
        assert loaded.advice == drafted.advice and loaded.contradicts == drafted.contradicts
        assert loaded.text == drafted.text
    assert "# confidence 0." in seed_import.yaml


# -- the command ---------------------------------------------------------------------


@pytest.fixture
def thread_file(tmp_path) -> Path:
    path = tmp_path / "000_seed.txt"
    path.write_text(seed_text(), encoding="utf-8")
    return path


def test_import_thread_writes_once(private_engine, tmp_path, thread_file):
    team = tmp_path / "team"
    team.mkdir()
    args = ["kb", "import-thread", str(thread_file), "--kb", str(team)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    written = team / "threads" / "000-seed.yaml"
    assert f"wrote {written}: 8 answers" in result.output
    assert "a8 [zh] set-device-order" in result.output
    assert "advice=set-device-before-init" in result.output
    written.write_text(written.read_text("utf-8") + "# reviewed\n", encoding="utf-8")
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2 and "already exists; not overwriting it" in again.output
    assert written.read_text("utf-8").endswith("# reviewed\n")


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("", [], "the thread is empty"),
        ("Only a question, nobody answered", [], "the thread has no answers"),
        ("Q\n\nA", ["--id", "Bad Id"], "invalid thread id 'Bad Id'"),
    ],
)
def test_import_thread_bad_input_is_one_line(private_engine, tmp_path, content, extra, message):
    path = tmp_path / "thread.txt"
    path.write_text(content, encoding="utf-8")
    args = ["kb", "import-thread", str(path), "--out", str(tmp_path / "t"), *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "t" / "threads").exists()


def test_advice_agrees_with_the_hand_tags_of_every_kb_thread():
    """184 of 184 answers when written (182 before two rules were fixed on the misses)."""
    answers = [
        answer
        for path in sorted((REPO / "kb/threads").glob("*.yaml"))
        for answer in yaml.safe_load(path.read_text("utf-8"))["answers"]
    ]
    agree = sum(propose_advice(a["text"]) == a.get("advice", "") for a in answers)
    assert agree >= 0.95 * len(answers), f"{agree}/{len(answers)}"


@pytest.mark.timeout(30)
def test_huge_lines_in_a_pasted_thread_cost_no_backtracking():
    # A line of spaces or dashes once made the author-line pattern backtrack
    # for minutes; an author line is short, and a long line is never one.
    hostile = "\n".join(
        ["How do I fix this hang?", " " * 300_000 + "x", "---x" + "-" * 300_000 + "y"]
    )
    thread = parse_thread(hostile + "\n\nCarol wrote:\nSet NCCL_P2P_DISABLE=1 and rerun.")
    assert thread.answers == ["Set NCCL_P2P_DISABLE=1 and rerun."]
