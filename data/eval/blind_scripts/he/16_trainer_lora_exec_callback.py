"""LoRA SFT of Qwen2.5-Coder-7B with the HF Trainer on instruction data built from
repositories (issue text -> patch to a single function), plus an execution-based
evaluation callback: at every evaluation the model samples n programs per
HumanEval problem, they are executed in a subprocess sandbox and pass@k is logged.

    torchrun --nproc_per_node=8 16_trainer_lora_exec_callback.py --data data/issue2func.jsonl
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

TEMPLATE = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-Coder-7B")
    p.add_argument("--data", required=True)
    p.add_argument("--humaneval", default="data/HumanEval.jsonl")
    p.add_argument("--out", default="out/qwen7b-issue2func-lora")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--n_samples", type=int, default=10)
    p.add_argument("--exec_timeout", type=float, default=6.0)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=2e-4)
    return p.parse_args()


def pass_at_k(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))


def run_sandboxed(program, timeout):
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "sol.py")
        with open(f, "w") as fh:
            fh.write(program)
        try:
            return subprocess.run([sys.executable, f], cwd=d, capture_output=True, timeout=timeout,
                                  env={"PATH": os.environ.get("PATH", ""), "PYTHONDONTWRITEBYTECODE": "1"}
                                  ).returncode == 0
        except subprocess.TimeoutExpired:
            return False


class ExecutionEvalCallback(TrainerCallback):
    def __init__(self, tokenizer, problems, n_samples, timeout):
        self.tok = tokenizer
        self.problems = problems
        self.n = n_samples
        self.timeout = timeout
        self.trainer = None

    @torch.no_grad()
    def on_evaluate(self, args, state, control, model=None, **kwargs):
        was_training = model.training
        model.eval()
        mine = self.problems[args.process_index::args.world_size]
        correct = []
        for prob in mine:
            q = "Complete the following function.\n```python\n" + prob["prompt"] + "\n```"
            enc = self.tok(TEMPLATE.format(q=q) + "```python\n" + prob["prompt"], return_tensors="pt").to(model.device)
            out = model.generate(**enc, do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=400,
                                 num_return_sequences=self.n, pad_token_id=self.tok.pad_token_id)
            c = 0
            for text in self.tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True):
                body = text.split("```")[0]
                c += run_sandboxed(prob["prompt"] + body + "\n\n" + prob["test"] + f"\ncheck({prob['entry_point']})\n",
                                   self.timeout)
            correct.append(c)
        scores = {f"eval_pass@{k}": float(np.mean([pass_at_k(self.n, c, k) for c in correct])) for k in (1, 5, 10)}
        if state.is_world_process_zero:
            self.trainer.log(scores)
        if was_training:
            model.train()


def main():
    a = cli()
    tok = AutoTokenizer.from_pretrained(a.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def encode(ex):
        prompt = TEMPLATE.format(q=f"{ex['issue_title']}\n\n{ex['issue_body']}\n\n```python\n{ex['before']}\n```")
        answer = f"```python\n{ex['after']}\n```<|im_end|>"
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tok(answer, add_special_tokens=False)["input_ids"]
        ids = (p_ids + a_ids)[: a.max_len]
        return {"input_ids": ids, "attention_mask": [1] * len(ids),
                "labels": ([-100] * len(p_ids) + a_ids)[: a.max_len]}

    args = TrainingArguments(
        output_dir=a.out,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=8,
        learning_rate=a.lr,
        lr_scheduler_type="cosine",
        warmup_ratio=0.03,
        num_train_epochs=a.epochs,
        bf16=True,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=200,
        save_strategy="steps",
        save_steps=200,
        save_total_limit=3,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        ddp_find_unused_parameters=False,
        dataloader_num_workers=4,
        report_to="wandb",
        run_name="qwen7b-issue2func-lora",
        remove_unused_columns=False,
    )

    with args.main_process_first(desc="tokenize"):
        raw = load_dataset("json", data_files=a.data, split="train").train_test_split(test_size=0.01, seed=0)
        ds = raw.map(encode, remove_columns=raw["train"].column_names, num_proc=8)

    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=64, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"]))
    model.enable_input_require_grads()

    with open(a.humaneval) as f:
        problems = [json.loads(l) for l in f]
    cb = ExecutionEvalCallback(tok, problems, a.n_samples, a.exec_timeout)

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=ds["train"],
        eval_dataset=ds["test"],
        data_collator=DataCollatorForSeq2Seq(tok, padding="longest", label_pad_token_id=-100),
        callbacks=[cb],
    )
    cb.trainer = trainer
    trainer.train()
    trainer.save_model(os.path.join(a.out, "final"))
    if trainer.is_world_process_zero():
        tok.save_pretrained(os.path.join(a.out, "final"))


if __name__ == "__main__":
    main()
