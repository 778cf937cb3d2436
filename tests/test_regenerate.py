"""`python -m treedec.regenerate` on a tiny random target: text and chat records keep their ids and format and feed
`data=jsonl` as a directory or a glob of shards; malformed lines name their line (or are skipped and counted); a run
killed with SIGKILL or stopped by SIGTERM resumes to the uninterrupted output; parts and 2-process DDP give the
1-process output (a rank without a shard idles); prompts are whole characters, special-token text stays text, sampled
records are seeded by line; corrupt state files are named, a shard without stats is redone."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers import compose_config

SPECIAL = 'SEP = "<|endoftext|>"\nx = 1\n'
CODE = ["def add(a, b):\n    return a + b\n", "class Stack:\n    def push(self, x):\n", "import os\nprint(os.getcwd())\n",
        "for i in range(10):\n    print(i)\n", "x = [1, 2, 3]\ny = sorted(x)\n", "with open(p) as f:\n    data = f.read()\n"]


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def args(stack, inp, out, *extra) -> list[str]:
    return [f"model.path={stack / 'target'}", "model.dtype=float32", f"draft.path={stack / 'draft'}", f"input={inp}",
            "max_new_tokens=16", "prompt_tokens=5", "shard_size=2", "batch_size=2", "progress=false", "num_threads=1",
            "trainer.enable_model_summary=false", f"out_dir={out}", *extra]


def regenerate(stack, inp, out, *extra) -> dict:
    from treedec.regenerate import run

    return run(compose_config("regenerate", args(stack, inp, out, f"paths.run_dir={out}", *extra)))


def shards(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "shards").glob("*.jsonl"))}


def records(out) -> list[dict]:
    return [json.loads(line) for text in shards(out).values() for line in text.decode().splitlines()]


@pytest.fixture(scope="module")
def text_input(tmp_path_factory):
    d = tmp_path_factory.mktemp("regen_in")
    return write_jsonl(d / "code.jsonl", [{"text": t, **({"id": f"doc{i}"} if i % 2 else {})}
                                          for i, t in enumerate(CODE * 2)])


@pytest.fixture(scope="module")
def reference(stack, text_input, tmp_path_factory):
    """One uninterrupted single-process run: what every split or resumed run must reproduce."""
    out = tmp_path_factory.mktemp("regen_ref")
    return out, regenerate(stack, text_input, out)


def test_text_records_keep_ids_and_feed_the_jsonl_data_module(stack, text_input, reference, tokenizer, tmp_path):
    from treedec.data.datamodules import JsonlDataModule
    from treedec.models.tokenizer import load_tokenizer

    out, m = reference
    got = records(out)
    assert [r["id"] for r in got] == [f"doc{i}" if i % 2 else i + 1 for i in range(12)]  # own id, else line number
    tok = load_tokenizer(stack / "target")
    for r, src in zip(got, CODE * 2):
        prompt = tok.decode(tok.encode(src)[:5])
        assert r["text"].startswith(prompt) and len(tok.encode(r["text"])) > 5  # the prompt, then the target's text
    assert m["records"] == 12 and m["complete"] and m["shards"] == 6 and m["skipped_lines"] == 0
    assert m["new_tokens"] > 0 and m["tau"] >= 1.0 and len(m["tau_per_shard"]) == 6
    assert json.loads((out / "metrics.json").read_text())["records"] == 12
    for path, n in ((out / "shards", 12), (out / "shards" / "part-0000[01].jsonl", 4)):
        dm = JsonlDataModule(str(path), str(tokenizer[0]), val_path=str(out / "shards" / "part-00005.jsonl"),
                             seq_len=16, batch_size=2, cache_dir=str(tmp_path / "cache"))
        dm.setup("fit")
        assert dm.meta["format"] == "text" and dm.meta["splits"]["train"]["docs"] == n


def test_chat_assistant_turns_are_regenerated_in_place(stack, tokenizer, tmp_path):
    from treedec.data.datamodules import JsonlDataModule

    chats = [
        {"id": "c1", "conversations": [{"from": "human", "value": "add two numbers"}, {"from": "gpt", "value": "OLD"},
                                       {"from": "human", "value": "and subtract"}, {"from": "gpt", "value": "OLD"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort a list"},
                      {"role": "assistant", "content": "OLD"}], "source": "kept"},
        {"conversations": [{"from": "human", "value": "read a file"}, {"from": "gpt", "value": "OLD"}]},
    ]
    inp = write_jsonl(tmp_path / "chat.jsonl", chats)
    m = regenerate(stack, inp, tmp_path / "out")
    got = records(tmp_path / "out")
    assert [r["id"] for r in got] == ["c1", 2, 3] and got[1]["source"] == "kept"
    for new, old in zip(got, chats):
        key, text = ("conversations", "value") if "conversations" in old else ("messages", "content")
        assert [set(t) for t in new[key]] == [set(t) for t in old[key]]  # the record's own field names
        for t_new, t_old in zip(new[key], old[key]):
            assistant = t_old.get("from", t_old.get("role")) in ("gpt", "assistant")
            assert (t_new[text] != "OLD") if assistant else (t_new == t_old)
    assert m["records"] == 3 and m["complete"]
    dm = JsonlDataModule(str(tmp_path / "out" / "shards"), str(tokenizer[0]), val_path=inp, seq_len=64,
                         batch_size=2, cache_dir=str(tmp_path / "cache"))
    dm.setup("fit")
    assert dm.is_chat and len(dm.train_set) >= 1


def test_malformed_line_names_its_line_or_is_skipped_and_counted(stack, tmp_path):
    inp = write_jsonl(tmp_path / "bad.jsonl", [{"text": CODE[0]}, '{"text": "unterminated', {"text": CODE[1]},
                                               {"txt": "wrong key"}, {"text": CODE[2]}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON.*on_error=skip"):
        regenerate(stack, inp, tmp_path / "fail")
    assert not (tmp_path / "fail" / "shards").exists()  # nothing decoded before the input was checked
    m = regenerate(stack, inp, tmp_path / "skip", "on_error=skip")
    assert m["skipped_lines"] == 2 and [s["line"] for s in m["skipped"]] == [2, 4]
    assert "needs a 'text' string" in m["skipped"][1]["error"]
    assert m["records"] == 3 and [r["id"] for r in records(tmp_path / "skip")] == [1, 3, 5]


def test_parts_union_equals_one_process(stack, text_input, reference, tmp_path):
    out = tmp_path / "parts"
    a = regenerate(stack, text_input, out, "part=1", "parts=2")
    assert not a["complete"] and a["shards_done"] == 3  # shards 1, 3, 5
    b = regenerate(stack, text_input, out, "part=0", "parts=2")
    assert b["complete"] and b["this_run"]["shards"] == 3
    assert shards(out) == shards(reference[0])


def test_records_served_through_fewer_slots_equal_one_batch_at_a_time(stack, text_input, reference, tmp_path):
    """slots=1: each batch's records queue for one row (continuous batching); the records are the same."""
    out = tmp_path / "slots"
    m = regenerate(stack, text_input, out, "slots=1")
    assert m["complete"] and shards(out) == shards(reference[0])
    assert "slots" not in json.loads((out / "manifest.json").read_text())  # free to change on resume


def test_slots_may_change_on_resume_and_a_kernel_change_is_named_kernel(stack, text_input, tmp_path):
    out = tmp_path / "out"
    regenerate(stack, text_input, out, "part=0", "parts=3")
    assert regenerate(stack, text_input, out, "part=0", "parts=3", "slots=1")["this_run"]["shards"] == 0
    with pytest.raises(ValueError, match=r"another input or config \(differs in: kernel\)"):
        regenerate(stack, text_input, out, "part=0", "parts=3", "kernel=eager")
    path = out / "manifest.json"  # an older run's manifest: the kernel inside model, slots recorded
    old = json.loads(path.read_text())
    old["model"]["attn_backend"] = old.pop("kernel")
    path.write_text(json.dumps({**old, "slots": 4}))
    assert regenerate(stack, text_input, out, "part=0", "parts=3")["shards_done"] == 2


def test_resume_refuses_other_settings_and_a_running_worker(stack, text_input, reference, tmp_path):
    from treedec.training.run_dir import JobError, RunDirLock

    out = tmp_path / "out"
    regenerate(stack, text_input, out, "part=0", "parts=3")
    with pytest.raises(ValueError, match=r"another input or config \(differs in: max_new_tokens\)"):
        regenerate(stack, text_input, out, "max_new_tokens=8")
    claim = out / ".claims" / "worker-1-of-3"
    claim.mkdir(parents=True)
    with RunDirLock(claim), pytest.raises(JobError, match="in use by another job"):
        regenerate(stack, text_input, out, "part=1", "parts=3")


def test_prompts_are_whole_characters_and_special_token_text_stays_text(stack, tmp_path):
    from treedec.models.tokenizer import load_tokenizer
    from treedec.training.regen_requests import Record, TextRequest

    tok = load_tokenizer(stack / "target")
    text = "# 注释：世界你好。😀\n" * 8
    for n in range(1, 40):  # byte-level tokens: most cuts fall inside a character
        prompt = tok.decode(TextRequest(Record(0, 1, {"text": text}, "text", text), tok, n).ids)
        assert "\ufffd" not in prompt and text.startswith(prompt)
    inp = write_jsonl(tmp_path / "special.jsonl", [{"text": SPECIAL}])
    regenerate(stack, inp, tmp_path / "out", "prompt_tokens=64")
    assert records(tmp_path / "out")[0]["text"].startswith(SPECIAL)  # not 'SEP = ""' (an EOS mid-prompt)


def test_sampled_records_sharing_an_id_get_their_own_samples_and_a_rerun_the_same(stack, tmp_path):
    inp = write_jsonl(tmp_path / "same.jsonl", [{"text": CODE[0], "id": i} for i in ("x", "x", None, None)])
    hot = ["sampling=sample", "sampling.temperature=3", "sampling.top_p=1.0"]  # (the random target is peaked)
    regenerate(stack, inp, tmp_path / "a", *hot)
    texts = [r["text"] for r in records(tmp_path / "a")]
    assert [r["id"] for r in records(tmp_path / "a")] == ["x", "x", None, None]
    assert texts[0] != texts[1] and texts[2] != texts[3]  # seeded by line, not by the (shared) id
    regenerate(stack, inp, tmp_path / "b", *hot)
    assert shards(tmp_path / "b") == shards(tmp_path / "a")


def test_lone_surrogates_and_deep_nesting_are_malformed_lines_named_before_decoding(tokenizer, tmp_path):
    from treedec.data.token_cache import tokenize_jsonl
    from treedec.training.regen_requests import read_records

    inp = write_jsonl(tmp_path / "bad.jsonl", [{"text": CODE[0]}, '{"text": "a\\ud800b"}', "[" * 100_000,
                                               '{"text": "ok", "meta": ["\\udc00"]}', {"text": CODE[1]}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: holds a lone UTF-16 surrogate.*on_error=skip"):
        read_records(inp)
    recs, skipped = read_records(inp, on_error="skip")
    assert [r.line for r in recs] == [1, 5] and [s["line"] for s in skipped] == [2, 3, 4]
    assert "nested too deeply" in skipped[1]["error"]
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: holds a lone UTF-16 surrogate"):  # train's reader too
        tokenize_jsonl(str(tokenizer[0]), inp, cache_dir=str(tmp_path / "cache"))


def test_corrupt_state_files_are_named_and_a_shard_without_stats_is_redone(stack, text_input, reference, tmp_path):
    out = tmp_path / "out"
    regenerate(stack, text_input, out, "part=0", "parts=3")  # shards 0 and 3
    stats = out / "shards" / "part-00003.stats.json"
    stats.unlink()  # its records stay: done for scheduling once, never in the metrics
    m = regenerate(stack, text_input, out, "part=0", "parts=3")
    assert m["this_run"]["shards"] == 1 and m["shards_done"] == 2 and stats.is_file()
    assert shards(out)["part-00003.jsonl"] == shards(reference[0])["part-00003.jsonl"]
    stats.write_text("")
    with pytest.raises(ValueError, match=r"part-00003\.stats\.json is corrupt \(not valid JSON.*delete it and re-run"):
        regenerate(stack, text_input, out, "part=0", "parts=3")
    (out / "manifest.json").write_text("{")
    with pytest.raises(ValueError, match=r"manifest\.json is corrupt \(not valid JSON.*delete it to resume"):
        regenerate(stack, text_input, out, "part=0", "parts=3")


def test_the_manifest_is_checked_and_written_under_the_state_lock(tmp_path):
    from treedec.training.regen_state import check_manifest

    with open(tmp_path / ".state.lock", "a") as held:  # another job holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        job = threading.Thread(target=check_manifest, args=(tmp_path, {"input": "a"}))
        job.start()
        job.join(0.3)
        assert job.is_alive() and not (tmp_path / "manifest.json").exists()
    job.join(10)
    assert json.loads((tmp_path / "manifest.json").read_text()) == {"input": "a"}


def subprocess_env() -> dict:
    from tests.training.test_ddp import ddp_env

    return ddp_env()


ONE_PER_SHARD = ("shard_size=1", "batch_size=1")


def start_until_shards(stack, text_input, out, log_path, n: int = 2) -> subprocess.Popen:
    """A ``python -m treedec.regenerate`` (one record a shard) in its own session, once it wrote ``n`` shards."""
    from tests.training.test_ddp import REPO

    cmd = [sys.executable, "-m", "treedec.regenerate", *args(stack, text_input, out, f"hydra.run.dir={out}",
                                                              *ONE_PER_SHARD)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.time() + 240
    while len(list((out / "shards").glob("*.jsonl"))) < n and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    return proc


def assert_resumes_to_an_uninterrupted_run(stack, text_input, reference, out, tmp_path) -> None:
    """The run was stopped mid-way; a re-run finishes it, token for token as a run that was never stopped."""
    done = len(shards(out))
    assert 2 <= done < 12  # stopped mid-run, finished shards kept
    m = regenerate(stack, text_input, out, *ONE_PER_SHARD)
    assert m["complete"] and m["this_run"]["shards"] == 12 - done and m["records"] == 12
    regenerate(stack, text_input, tmp_path / "through", *ONE_PER_SHARD)  # the same batches, never stopped
    assert shards(out) == shards(tmp_path / "through")  # complete, no duplicate, token for token
    assert [r["id"] for r in records(out)] == [r["id"] for r in records(reference[0])]
    assert not list((out / "shards").glob(".*.tmp"))


@pytest.mark.slow  # a subprocess: ~10 s of interpreter, torch and Lightning start-up
def test_kill_9_then_rerun_equals_an_uninterrupted_run(stack, text_input, reference, tmp_path):
    out = tmp_path / "killed"
    proc = start_until_shards(stack, text_input, out, tmp_path / "log")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "log").read_text()[-3000:]
    assert_resumes_to_an_uninterrupted_run(stack, text_input, reference, out, tmp_path)


@pytest.mark.slow  # a subprocess: ~10 s of interpreter, torch and Lightning start-up
def test_sigterm_stops_at_a_batch_boundary_keeps_shards_and_exits_143(stack, text_input, reference, tmp_path):
    out = tmp_path / "preempted"
    proc = start_until_shards(stack, text_input, out, tmp_path / "log")
    t0 = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    log = (tmp_path / "log").read_text()
    assert proc.returncode == 128 + signal.SIGTERM, log[-3000:]  # 143: preempted, not finished
    assert time.time() - t0 < 20 and "SIGTERM: stopped after" in log
    assert_resumes_to_an_uninterrupted_run(stack, text_input, reference, out, tmp_path)


@pytest.mark.slow  # two interpreters under DDP (gloo): ~30 s on two busy cores
def test_ddp_two_processes_equal_one(stack, text_input, reference, tmp_path):
    from tests.training.test_ddp import REPO

    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "treedec.regenerate", *args(stack, text_input, out, f"hydra.run.dir={out}"),
           "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "Starting with 2 processes" in log and "worker 1 of 2" in log
    assert shards(out) == shards(reference[0])  # the union, token for token (greedy fp32)
    m = json.loads((out / "metrics.json").read_text())
    assert m["complete"] and m["this_run"]["world_size"] == 2 and m["this_run"]["shards"] == 6


@pytest.mark.slow  # two interpreters under DDP (gloo): ~30 s on two busy cores
def test_ddp_rank_without_a_shard_idles_and_ends_cleanly(stack, tmp_path):
    from tests.training.test_ddp import REPO

    inp, out = write_jsonl(tmp_path / "two.jsonl", [{"text": t} for t in CODE[:2]]), tmp_path / "ddp"
    cmd = [sys.executable, "-m", "treedec.regenerate", *args(stack, inp, out, f"hydra.run.dir={out}"),
           "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]  # one shard for two ranks
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "worker 1 of 2: 0 shards" in log
    m = json.loads((out / "metrics.json").read_text())
    assert m["complete"] and m["records"] == 2 and m["this_run"]["world_size"] == 2
