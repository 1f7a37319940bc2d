"""What a run trains on, checked before the model loads: the training and evaluation examples, their
prompts as token ids, and the reward functions.

    load_data(args, log)   -> (train examples, eval examples, reward functions); a dataset or reward
                              that cannot be used stops the run in one line naming its flag
    encode(examples, ...)  -> the examples whose prompt fits --max-prompt-len, and their token ids

Where the rows come from is data.py's, how a row becomes an Example tasks.py's, how a reward function
is loaded and called reward_funcs.py's. Test: tests/test_train.py and tests/test_data.py (through
train.py).
"""
import os
import time

from tqdm import tqdm

import checks
import data
import reward_funcs
import tasks
from data import one_line

# ----------------------------------------------------------------------------------------------


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
