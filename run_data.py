"""What a run trains on, checked before the model loads: the training and evaluation examples, their
prompts as token ids, the reward functions, and the order the prompts are taken in.

    load_prompts(args, log) -> (tokenizer, PromptStream of the training prompts, eval examples): all of
                               the below, for train.py
    load_data(args, log)    -> (train examples, eval examples, reward functions); a dataset or reward
                               that cannot be used stops the run in one line naming its flag
    encode(examples, ...)   -> the examples whose prompt fits --max-prompt-len, and their token ids
    PromptStream            the training prompts in a per-epoch seeded order (step_seed), with the
                            position and the keep rate a checkpoint carries

Where the rows come from is data.py's, how a row becomes an Example tasks.py's, how a reward function
is loaded and called reward_funcs.py's. Test: tests/test_train.py and tests/test_data.py (through
train.py).
"""
import functools
import hashlib
import os
import time

import torch
from tqdm import tqdm

import checks
import data
import reward_funcs
import tasks
from checkpoint import load_tokenizer
from data import one_line
from distributed import rank_world

# ----------------------------------------------------------------------------------------------


def step_seed(seed: int, step: int, stream: str) -> int:
    """A distinct, reproducible seed for each (run seed, step, stream): resume-safe randomness."""
    digest = hashlib.sha256(f"{seed}/{step}/{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class PromptStream:
    """The training prompts in a per-epoch seeded order and the reward terms that score their completions.
    `position` counts the prompts taken so far and `keep_rate` is the share of informative groups the last
    step drew (1.0 before the first; it sizes dynamic sampling's rounds): a checkpoint stores both, so a
    resumed run takes the prompts, and sizes its rounds, as the uninterrupted run would have."""

    def __init__(self, examples: list, ids: list, funcs: list, seed: int):
        self.examples, self.ids, self.funcs, self.seed = examples, ids, funcs, seed
        self.position, self.keep_rate = 0, 1.0

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch: int) -> list:
        gen = torch.Generator().manual_seed(step_seed(self.seed, epoch, "data"))
        return torch.randperm(len(self.examples), generator=gen).tolist()

    def first_ids(self, n: int) -> list:
        """The token ids of the first n prompts of the data order (GPTQ's calibration); the position stays."""
        return [self.ids[i] for i in self._order(0)[:n]]

    def take(self, n: int) -> list[int]:
        """The next n prompt indices."""
        start, self.position = self.position, self.position + n
        return [self._order(i // len(self.examples))[i % len(self.examples)] for i in range(start, self.position)]


def load_prompts(args, log) -> tuple:
    """The datasets, the reward functions and the tokenizer, each refused with one line where it cannot be
    used -> (tokenizer, the PromptStream of the training prompts that fit, the encoded eval examples)."""
    progress = rank_world()[0] == 0
    train_set, eval_set, funcs = load_data(args, log)
    try:
        tokenizer = load_tokenizer(args.tokenizer or args.model)
    except (OSError, ValueError) as e:  # a Hub id that cannot be fetched (offline), a directory without one
        flag = "tokenizer" if args.tokenizer else "model"
        raise SystemExit(f"error: --{flag}: {tasks.load_problem(args.tokenizer or args.model, e)}") from None
    train_set, train_ids = encode(train_set, tokenizer, args, "train", log, progress=progress)
    if not train_set:
        raise SystemExit(f"error: no training prompt of {args.dataset} fits --max-prompt-len {args.max_prompt_len}")
    eval_set = encode(eval_set, tokenizer, args, "eval", log, progress=progress)[0]
    return tokenizer, PromptStream(train_set, train_ids, funcs, args.seed), eval_set


def load_data(args, log):
    """(train examples, eval examples, reward functions), each checked: a dataset or reward that cannot
    be used stops the run here, in one line naming its flag, before the tokenizer or the model loads."""
    columns = tasks.Columns(args.prompt_column, args.answer_column)
    eval_source, eval_config = checks.eval_source(args)

    def load(flag, source, split, config, limit=None):
        t0 = time.perf_counter()
        try:
            found = tasks.load_task(source, split, limit=limit, seed=args.seed, config=config, columns=columns)
        except (tasks.DatasetError, FileNotFoundError) as e:
            raise SystemExit(f"error: {flag}: {one_line(e)}") from None
        log(f"{flag} {source} [{split}]: {len(found)} examples ({time.perf_counter() - t0:.1f} s)")
        return found

    train_set = load("--dataset", args.dataset, args.dataset_split, args.dataset_config)
    eval_set = []
    if args.eval_limit:
        if eval_source is args.dataset and isinstance(args.dataset, data.Rows):
            log("warning: evaluating on the training rows (rows in memory are one split): pass eval_dataset for "
                "held-out questions")
        elif (eval_source, eval_config) == (args.dataset, args.dataset_config) and os.path.isfile(args.dataset):
            log(f"warning: evaluating on {args.dataset}, the training file (a file is one split): "
                f"pass --eval-dataset for held-out questions")
        eval_set = load("--eval-dataset", eval_source, args.eval_split, eval_config, args.eval_limit)
        if any(e.answer is None for e in eval_set):
            raise SystemExit(f"error: --eval-dataset {eval_source} has no gold answers, so accuracy cannot be measured: "
                             f"pass --answer-column, or --eval-limit 0")
    weights = args.reward_weights or [1.0] * len(args.reward)
    try:   # the workers flags.py started are reused
        funcs = [reward_funcs.load(spec, w, args.reward_timeout) for spec, w in zip(args.reward, weights)]
        reward_funcs.check(funcs, train_set)
    except ValueError as e:
        raise SystemExit(f"error: --reward: {e}") from None
    return train_set, eval_set, funcs


def encode(examples, tokenizer, args, what: str, log, progress: bool):
    """(the examples whose prompt fits --max-prompt-len, their prompt token ids); the rest are counted.
    A chat template that fails stops the run here, in one line."""
    try:
        ids = [tasks.encode_prompt(tokenizer, e.prompt, args.system_prompt, args.chat_template_kwargs)
               for e in tqdm(examples, desc=f"tokenizing {what} prompts", disable=not progress, leave=False)]
    except tasks.PromptError as e:
        raise SystemExit(f"error: {what} prompts: {e}") from None
    keep = [i for i, x in enumerate(ids) if len(x) <= args.max_prompt_len]
    if len(keep) < len(ids):
        log(f"{what} prompts: {len(ids) - len(keep)} of {len(ids)} longer than --max-prompt-len "
            f"{args.max_prompt_len} tokens: dropped")
    return [examples[i] for i in keep], [ids[i] for i in keep]
