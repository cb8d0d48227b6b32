"""A user's own task: prompts from their files (`data.*`), their reward functions
(`reward.*`), the arithmetic example (`examples/rl_loop/tasks`), and every bad input
refused in one line, before the run or at the step where it happens."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from colocate.engines.models import load_tokenizer
from colocate.engines.tiny import write_tiny_model
from examples.rl_loop.config import load_config
from examples.rl_loop.data import DataConfig, DataSampler, read_rows, render
from examples.rl_loop.loop import Loop
from examples.rl_loop.rewards import RewardConfig, RewardError, RewardFunctions, load_function
from examples.rl_loop.state import ResumeError
from examples.rl_loop.tasks import arithmetic

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "rl_loop" / "tasks"
ROWS = [{"prompt": "1+2=", "answer": "3", "level": 1},
        {"prompt": "4+4=", "answer": "8", "level": 2}]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- reading and sampling the data ----

def test_every_file_kind_reads_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(ROWS)
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "b.json").write_text(json.dumps(ROWS))
    pq.write_table(table, tmp_path / "d.parquet")
    saved = tmp_path / "e"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))
    for name in ("a.jsonl", "b.json", "d.parquet", "e"):
        assert read_rows([str(tmp_path / name)], "data.train_files", "prompt") == ROWS, name
    both = read_rows([str(tmp_path / "a.jsonl"), str(tmp_path / "d.parquet")], "x", "prompt")
    assert both == ROWS + ROWS


def test_bad_data_files_are_refused_naming_the_file_and_the_setting(tmp_path):
    def refused(match: str, name: str, key: str = "prompt") -> None:
        with pytest.raises((ValueError, FileNotFoundError), match=match):
            read_rows([str(tmp_path / name)], "data.train_files", key)

    refused(r"data.train_files: .*nowhere.jsonl: no such file", "nowhere.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    refused(r"empty.jsonl has no rows", "empty.jsonl")
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    refused(r"rows.jsonl, row 0 has no prompt in column 'question'.*\['answer', 'level', "
            r"'prompt'\]", "rows.jsonl", key="question")
    (tmp_path / "rows.csv").write_text("prompt\n1+2=\n")
    refused(r"rows.csv: not a data file this loop reads", "rows.csv")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "1+2="}\n{"prompt": \n')
    refused(r"broken.jsonl, line 2: not JSON", "broken.jsonl")
    (tmp_path / "splits").mkdir()
    (tmp_path / "splits" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    refused(r"several splits \(train, test\).*splits/train", "splits")


def test_the_sampler_shuffles_each_epoch_by_the_seed_and_goes_on_from_its_state():
    sampler = DataSampler(5, seed=3)
    first, second = sampler.sample(5), sampler.sample(5)
    assert sorted(first) == sorted(second) == list(range(5)) and first != second
    assert DataSampler(5, seed=3).sample(10) == first + second  # the seed fixes the orders
    assert DataSampler(5, seed=4).sample(5) != first
    a = DataSampler(5, seed=3)
    a.sample(7)  # into the second epoch
    saved = json.loads(json.dumps(a.state_dict()))  # as loop.json keeps it
    assert saved == {"kind": "data", "epoch": 1, "index": 2, "rows": 5}
    b = DataSampler(5, seed=3)
    b.load_state_dict(saved)
    assert a.sample(9) == b.sample(9)
    with pytest.raises(ResumeError, match="trained on 5 rows, the data files now hold 6"):
        DataSampler(6, seed=3).load_state_dict(saved)
    with pytest.raises(ResumeError, match="the digit task's"):
        DataSampler(5, seed=3).load_state_dict({"version": 3, "internal": [], "gauss": None})


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")


def chat_model(path: Path) -> Path:
    """A tiny model whose character tokenizer has a chat template: `u:1+2=;a:`."""
    write_tiny_model(path, alphabet="0123456789+=>:;uas", max_positions=32, init_std=0.1)
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


def test_prompts_render_as_text_or_through_the_chat_template(tmp_path):
    tokenizer = load_tokenizer(chat_model(tmp_path / "model"))
    chat = [{"prompt": [{"role": "user", "content": "1+2="}], "answer": "3"}]
    [row], dropped = render(chat, DataConfig(), tokenizer, "data.train_files")
    assert row.chat and row.text == "u:1+2=;a:" and dropped == 0
    assert tokenizer.decode(row.tokens) == "u:1+2=;a:"  # no bos: the template places its own
    assert row.columns == {"answer": "3"}
    rows, dropped = render(ROWS + [{"prompt": "12+34=", "answer": "46"}],
                           DataConfig(max_prompt_length=5), tokenizer, "data.train_files")
    assert [r.text for r in rows] == ["1+2=", "4+4="] and dropped == 1  # bos + 6 > 5
    with pytest.raises(ValueError, match="row 2: the prompt is 7 tokens, over "
                                         "data.max_prompt_length=5"):
        render(ROWS + [{"prompt": "12+34=", "answer": "46"}],
               DataConfig(max_prompt_length=5, too_long="error"), tokenizer, "data.train_files")
    with pytest.raises(ValueError, match="all 2 prompts are longer"):
        render(ROWS, DataConfig(max_prompt_length=2), tokenizer, "data.train_files")
    plain = load_tokenizer(write_tiny_model(tmp_path / "plain", alphabet="0123456789+="))
    with pytest.raises(ValueError, match="row 0: the prompt is chat messages, but the model's "
                                         "tokenizer has no chat template"):
        render(chat, DataConfig(), plain, "data.train_files")
    with pytest.raises(ValueError, match="holds int .7.: expected text or chat messages"):
        render([{"prompt": 7}], DataConfig(), plain, "data.train_files")


# ---- reward functions ----

REWARDS = '''
import asyncio
import math

def exact(prompts, completions, completion_ids, answer, **kwargs):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

async def only_level_2(completions, level, **kwargs):
    await asyncio.sleep(0.01)
    return [float(len(c)) if lv == 2 else None for c, lv in zip(completions, level)]

def columns_seen(prompts, completions, completion_ids, **columns):
    return [len(columns)] * len(prompts)

def raises_on_4(prompts, completions, **kwargs):
    if "4+4=" in prompts:
        raise ZeroDivisionError("on purpose")
    return [0.5] * len(prompts)

def too_few(prompts, **kwargs):
    return [0.5] * (len(prompts) - 1)

def text_on_4(prompts, **kwargs):
    return ["high" if p == "4+4=" else 0.5 for p in prompts]

def nan_on_4(prompts, **kwargs):
    return [math.nan if p == "4+4=" else 0.5 for p in prompts]

def never(prompts, **kwargs):
    return [None] * len(prompts)

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def reward_file(tmp_path) -> str:
    """A reward module outside the repo, not on the path: named by its file."""
    path = tmp_path / "outside" / "my_rewards.py"
    path.parent.mkdir()
    path.write_text(REWARDS)
    return str(path)


def score(reward_file: str, *names: str, **options) -> object:
    cfg = RewardConfig(funcs=[f"{reward_file}:{n}" for n in names], **options)
    functions = RewardFunctions(cfg)
    try:
        return asyncio.run(functions.score(
            "step 3", ["1+2=", "4+4=", "1+2="], ["3", "8", "4"], [[5], [10], [6]],
            {"answer": ["3", "8", "3"], "level": [1, 2, 1]}))
    finally:
        functions.close()


def test_reward_functions_get_the_columns_weights_and_none(reward_file):
    scores = score(reward_file, "exact", "only_level_2", weights=[2.0, 0.5])
    assert scores.values == [2.0, 2.0 + 0.5 * 1, 0.0]  # None: left out of the sum
    metrics = scores.metrics()
    assert metrics["rewards/exact/mean"] == pytest.approx(2 / 3)
    assert metrics["rewards/only_level_2/mean"] == 1.0  # over the one sample it scored
    assert metrics["rewards/only_level_2/std"] == 0.0
    assert score(reward_file, "columns_seen").values == [2.0] * 3  # answer and level
    unscored = score(reward_file, "never")
    assert unscored.values == [None] * 3 and unscored.skipped == [0, 1, 2]


def test_reward_functions_in_a_process_pool_give_the_same_values(reward_file):
    here = score(reward_file, "exact", "only_level_2")
    pooled = score(reward_file, "exact", "only_level_2", workers=2)
    assert pooled.values == here.values


@pytest.mark.parametrize("name, what", [
    ("raises_on_4", r"raised ZeroDivisionError: on purpose"),
    ("too_few", r"returned 0 values for 1 completion"),
    ("text_on_4", r"returned 'high' \(str\), not a number or None"),
    ("nan_on_4", r"returned nan, not a finite number"),
])
def test_each_failure_of_a_reward_function_names_it_the_step_and_the_sample(
        reward_file, name, what):
    message = rf"reward function .*my_rewards.py:{name} at step 3, sample 1 " \
              rf"\(prompt '4\+4='\): {what}"
    if name == "too_few":  # every sample alone fails too: the first is named
        message = message.replace("sample 1 ", "sample 0 ").replace("4\\+4=", "1\\+2=")
    with pytest.raises(RewardError, match=message):
        score(reward_file, name)
    skipped = score(reward_file, name, on_error="skip")
    assert skipped.dropped == ([0, 1, 2] if name == "too_few" else [1])
    assert skipped.metrics()["samples_dropped"] == len(skipped.dropped)


def test_unknown_modules_and_functions_are_refused(reward_file, tmp_path):
    cases = {
        "no_such_module_xyz:f": r"no module 'no_such_module_xyz' on the path",
        f"{tmp_path}/missing.py:f": r"no such file .*missing.py",
        f"{reward_file}:nope": r"my_rewards.py has no 'nope'",
        f"{reward_file}:NOT_A_FUNCTION": r"NOT_A_FUNCTION is a int, not a function",
    }
    for spec, match in cases.items():
        with pytest.raises(RewardError, match=match):
            load_function(spec)
    assert load_function("math:sqrt") is math.sqrt  # a module on the path


def test_bad_settings_are_refused_at_config_time():
    data = ["data.train_files=[a.jsonl]", "data.eval_files=[b.jsonl]",
            "grpo.max_completion_length=4"]
    cases = {
        ("grpo.kl_coef=0.1",): "kl_coef",  # an old name of beta: no field of the config
        (*data,): "data.train_files needs reward.funcs",
        ("reward.funcs=[m:f]",): "reward.funcs without data.train_files",
        ("data.train_files=[a.jsonl]",): "data.train_files needs data.eval_files",
        (*data[:2], "reward.funcs=[m:f]"): "needs grpo.max_completion_length",
        (*data, "reward.funcs=[m:f]", "reward.weights=[1,2]"): "2 weight\\(s\\) for 1",
        (*data, "reward.funcs=[f]"): "write module:function",
        (*data, "reward.funcs=[m:f]", "reward.on_error=retry"): "reward.on_error='retry'",
        (*data, "reward.funcs=[m:f]", "data.too_long=cut"): "data.too_long='cut'",
    }
    for overrides, match in cases.items():
        with pytest.raises(ValueError, match=match):
            load_config(overrides=list(overrides))


# ---- whole runs ----

def user_task(tmp_path: Path, *overrides: str, train: list[dict] | None = None,
              rewards: str = "exact") -> list[str]:
    """The overrides of a run on a task in tmp_path (data and reward module outside the
    repo): a few steps, 8 prompts a step."""
    data = tmp_path / "task"
    data.mkdir(exist_ok=True)
    rows = train or [{"prompt": f"{a}+{b}=", "answer": str(a + b), "level": 1 + (a > 4)}
                     for a in range(10) for b in range(3)]
    write_jsonl(data / "train.jsonl", rows)
    write_jsonl(data / "eval.jsonl", rows[:8])
    funcs = ",".join(f"{data / 'rewards.py'}:{name}" for name in rewards.split(","))
    return [f"data.train_files=[{data / 'train.jsonl'}]",
            f"data.eval_files=[{data / 'eval.jsonl'}]", f"reward.funcs=[{funcs}]",
            "grpo.max_completion_length=3", "grpo.prompts_per_step=8", "run.steps=3",
            "run.eval_every=3", "run.seed=5", f"run.out={tmp_path / 'run'}", *overrides]


RECORDING = '''
import json
from pathlib import Path

CALLS = Path(__file__).with_name("calls.jsonl")

def exact(prompts, completions, completion_ids, answer, level, **kwargs):
    with CALLS.open("a") as out:
        out.write(json.dumps({"prompts": prompts, "completions": completions,
                              "ids": completion_ids, "answer": answer, "level": level,
                              "other": sorted(kwargs)}) + "\\n")
    return [1.0 if str(c).strip() == a else 0.0 for c, a in zip(completions, answer)]

def fails_at_the_fourth_call(prompts, completions, **kwargs):
    global COUNT
    COUNT = globals().get("COUNT", 0) + 1
    if COUNT == 4:  # untrained eval, steps 0 and 1, then step 2
        raise ValueError("the verifier broke")
    return [0.0] * len(prompts)
'''


def calls(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in
            (tmp_path / "task" / "calls.jsonl").read_text().splitlines()]


async def test_a_task_from_a_folder_outside_the_repo_runs_with_its_columns(tmp_path):
    overrides = user_task(tmp_path)
    (tmp_path / "task" / "rewards.py").write_text(RECORDING)
    summary = await Loop(load_config(overrides=overrides)).run()
    assert summary["train_prompts"] == 30 and summary["eval_prompts"] == 8
    assert summary["untrained_eval_reward"] is not None and summary["final_eval_reward"] >= 0
    seen = calls(tmp_path)
    assert len(seen) == 1 + 3 + 1  # the untrained eval, 3 steps, the final eval
    step = seen[1]
    assert len(step["prompts"]) == 8 * 4 and step["other"] == []
    for prompt, answer, level in zip(step["prompts"], step["answer"], step["level"],
                                     strict=True):  # each sample with its own row's columns
        a, b = int(prompt[0]), int(prompt[2])
        assert answer == str(a + b) and level == 1 + (a > 4)
    assert all(1 <= len(ids) <= 3 for ids in step["ids"])
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    row = metrics["steps"][1]
    for key in ("rewards/exact/mean", "rewards/exact/std", "clip_frac", "kl",
                "completion_len_mean", "truncated_share"):
        assert key in row, key
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert len(events.Scalars("rl/rewards/exact/mean")) == 3


async def test_chat_prompts_go_through_the_chat_template(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b),
             "level": 1} for a in range(5) for b in range(2)]
    overrides = user_task(tmp_path, f"model.path={chat_model(tmp_path / 'model')}",
                          "run.steps=1", "run.eval_every=1", train=rows)
    (tmp_path / "task" / "rewards.py").write_text(RECORDING)
    await Loop(load_config(overrides=overrides)).run()
    step = calls(tmp_path)[1]
    assert step["prompts"][0][0]["role"] == "user"  # as the file holds them
    completion = step["completions"][0]  # TRL's form for a chat prompt: messages
    assert completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)


async def test_a_missing_file_is_refused_before_the_run_with_metrics_written(tmp_path):
    overrides = user_task(tmp_path)
    (tmp_path / "task" / "rewards.py").write_text(RECORDING)
    (tmp_path / "task" / "eval.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="data.eval_files: .*eval.jsonl: no such file"):
        Loop(load_config(overrides=overrides))
    failed = json.loads((tmp_path / "run" / "metrics.json").read_text())["summary"]["failed"]
    assert "eval.jsonl: no such file" in failed
    overrides = user_task(tmp_path, rewards="nope")  # a function the module lacks
    with pytest.raises(RewardError, match="rewards.py has no 'nope'"):
        Loop(load_config(overrides=overrides))
    too_long = user_task(tmp_path, "grpo.max_completion_length=40")
    with pytest.raises(ValueError, match=r"need 45 positions; the model has 16"):
        Loop(load_config(overrides=too_long))
    served = user_task(tmp_path, "model.max_positions=64", "run.engine=vllm",
                       "generator.max_model_len=32", "grpo.max_completion_length=30")
    with pytest.raises(ValueError, match=r"need 35 positions; the generator serves 32 "
                                         r"\(generator.max_model_len\): raise it"):
        Loop(load_config(overrides=served))
    partial = user_task(tmp_path, "model.max_positions=64", "run.engine=vllm",
                        "generator.max_model_len=32", "rollout.mode=partial",
                        "rollout.max_tokens_per_step=8", "grpo.max_completion_length=25")
    with pytest.raises(ValueError, match=r"need 37 positions; the run has 32"):
        Loop(load_config(overrides=partial))


async def test_a_failing_reward_function_stops_the_run_at_its_step_keeping_the_steps_done(
        tmp_path):
    overrides = user_task(tmp_path, "run.steps=4", rewards="fails_at_the_fourth_call")
    (tmp_path / "task" / "rewards.py").write_text(RECORDING)
    with pytest.raises(RewardError, match=r"fails_at_the_fourth_call at step 2, sample 0 "
                                          r"\(prompt '.\+.='\): raised ValueError: the "
                                          "verifier broke"):
        await Loop(load_config(overrides=overrides)).run()
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert "RewardError" in metrics["summary"]["failed"]
    assert [s["step"] for s in metrics["steps"]] == [-1, 0, 1]


async def test_a_resumed_run_on_a_data_file_is_the_same_run(tmp_path):
    """4 steps in one go, and 2 steps then a resume to 4: the same per-step metrics (the
    data's position is in the checkpoint)."""
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "rewards.py").write_text(RECORDING)

    def overrides(out: str, steps: int) -> list[str]:
        return [*user_task(tmp_path, f"run.steps={steps}", "run.eval_every=1",
                           "run.save_every=2", "grpo.prompts_per_step=12"),
                f"run.out={tmp_path / out}"]  # 30 rows, 12 a step: epochs cross mid-step

    await Loop(load_config(overrides=overrides("full", 4))).run()
    await Loop(load_config(overrides=overrides("part", 2))).run()
    summary = await Loop(load_config(overrides=overrides("part", 4))).run()
    assert summary["resumed_at"] == 2
    keys = ("reward", "loss", "grad_norm", "eval_reward", "rewards/exact/mean")

    def compared(out: str) -> list[tuple]:
        steps = json.loads((tmp_path / out / "metrics.json").read_text())["steps"]
        return [(s["step"], *(s.get(k) for k in keys)) for s in steps]

    assert compared("part") == compared("full")
    assert len(compared("full")) == 5


async def test_the_arithmetic_example_learns_on_cpu_with_the_default_tiny_model(tmp_path):
    """The README's "Your own task", as written there but shorter (measured, seed 0: eval
    0.05 untrained, 0.58 at step 25, 0.59 at 100, of 1.5: `correct` + 0.5 x `is_number`)."""
    train, evaluation = arithmetic.write(tmp_path / "data")
    reward = EXAMPLE / "arithmetic_reward.py"
    cfg = load_config(overrides=[
        f"data.train_files=[{train}]", f"data.eval_files=[{evaluation}]",
        f"reward.funcs=[{reward}:correct,{reward}:is_number]", "reward.weights=[1.0,0.5]",
        "grpo.max_completion_length=3", "run.steps=50", "run.eval_every=50",
        "run.save_every=0", f"run.out={tmp_path / 'run'}"])
    summary = await Loop(cfg).run()
    assert summary["final_eval_reward"] >= summary["untrained_eval_reward"] + 0.3
    steps = json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"]
    assert steps[-1]["rewards/correct/mean"] > steps[1]["rewards/correct/mean"]
