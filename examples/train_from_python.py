"""The addition demo (examples/addition.yaml) from Python, written as a TRL user writes a GRPOTrainer
script: the rows in memory, a reward function in TRL's signature, TRL's names for the settings, and a
callback that hears of each evaluation and checkpoint.

    python tools/get_smollm2.py && python examples/train_from_python.py [--model DIR] [--max-steps N]

flags.config checks the settings as the command line's are (the TRL names it read are said in one
line); train.train runs them, exactly as `python train.py --config ...` does, and returns a summary.
The reward function runs in a worker process, which imports this file to find it: so the training
stays under `if __name__ == "__main__":`, and the heavy imports (torch, through flags and train) sit
inside main, which the worker never calls.
"""
import argparse
import os
import random
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM_PROMPT = "Answer in one line: a + b = c."


def sums(seed: int = 0) -> list[dict]:
    """Every 'What is a + b?' of two-digit a and b, with its gold answer, in a seeded order."""
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(rows)
    return rows


def ends_with_the_sum(prompts, completions, answer, **kwargs) -> list[float]:
    """TRL's reward signature: 1.0 where the completion's last number is the gold sum, else 0.0. The
    dataset's `answer` column arrives by name, one value per completion."""
    found = [re.findall(r"-?\d+", text) for text in completions]
    return [1.0 if numbers and numbers[-1] == gold else 0.0 for numbers, gold in zip(found, answer)]


def main(argv=None) -> dict:
    sys.path.insert(0, ROOT)
    import flags
    import train

    class Report(train.Callback):
        """Prints what a callback hears: the evaluations and the checkpoints."""

        def on_evaluate(self, step, metrics):
            print(f"callback: step {step}: eval accuracy {metrics['eval/accuracy']:.3f}")

        def on_save(self, step, checkpoint):
            print(f"callback: step {step}: saved {checkpoint}")

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="~/.cache/qerl/SmolLM2-135M-Instruct", help="the base model directory")
    p.add_argument("--max-steps", type=int, default=20, help="steps of training")
    p.add_argument("--output-dir", default="runs/addition-python", help="the run directory")
    args = p.parse_args(argv)
    rows = sums()
    config = flags.config(
        model_name_or_path=args.model, quant="bf16", system_prompt=SYSTEM_PROMPT,
        train_dataset=rows[1000:], eval_dataset=rows[:1000], eval_limit=100, reward_funcs=[ends_with_the_sum],
        num_generations=8, prompts_per_step=8, max_completion_length=16, lora_r=16, lora_alpha=32,
        learning_rate=5e-4, dynamic_sampling=False, max_steps=args.max_steps, eval_steps=5, save_steps=20,
        logging_steps=1, output_dir=args.output_dir)
    result = train.train(config, callbacks=[Report()])
    print(f"result: {result}")
    return result


if __name__ == "__main__":
    main()
