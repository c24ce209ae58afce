# -*- coding: utf-8 -*-
"""
Evol-Instruct fine-tuning of SantaCoder (1.1B) on instructions evolved from
repository snippets, with HumanEval + MBPP execution-based evaluation.

Usage:
    torchrun --nproc_per_node=8 14_santacoder_evol_instruct.py \
        --train_file data/evol_repo_80k.json --output_dir ckpt/santacoder-evol
"""
import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from datetime import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup

PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately "
          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:")

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="SantaCoder evol-instruct SFT")
    parser.add_argument("--model_name_or_path", type=str, default="bigcode/gpt_bigcode-santacoder")
    parser.add_argument("--train_file", type=str, required=True)
    parser.add_argument("--humaneval_file", type=str, default="data/HumanEval.jsonl")
    parser.add_argument("--mbpp_file", type=str, default="data/mbpp_test.jsonl")
    parser.add_argument("--output_dir", type=str, default="ckpt/santacoder-evol")
    parser.add_argument("--model_max_length", type=int, default=2048)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--warmup_steps", type=int, default=30)
    parser.add_argument("--logging_steps", type=int, default=10)
    parser.add_argument("--exec_timeout", type=float, default=5.0)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class EvolInstructDataset(Dataset):
    def __init__(self, path, tokenizer, max_length):
        with open(path) as f:
            raw = json.load(f)
        self.data = []
        for ex in raw:
            source = PROMPT.format(instruction=ex["instruction"])
            target = f"{ex['output']}{tokenizer.eos_token}"
            s = tokenizer(source, add_special_tokens=False)["input_ids"]
            t = tokenizer(target, add_special_tokens=False)["input_ids"]
            input_ids = (s + t)[:max_length]
            labels = ([-100] * len(s) + t)[:max_length]
            self.data.append((input_ids, labels))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        return self.data[idx]


class DataCollator:
    def __init__(self, pad_token_id):
        self.pad_token_id = pad_token_id

    def __call__(self, instances):
        max_len = max(len(x) for x, _ in instances)
        input_ids = torch.full((len(instances), max_len), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(instances), max_len), -100, dtype=torch.long)
        attention_mask = torch.zeros((len(instances), max_len), dtype=torch.long)
        for i, (x, y) in enumerate(instances):
            input_ids[i, : len(x)] = torch.tensor(x)
            labels[i, : len(y)] = torch.tensor(y)
            attention_mask[i, : len(x)] = 1
        return dict(input_ids=input_ids, labels=labels, attention_mask=attention_mask)


def execute_with_timeout(source, timeout):
    with tempfile.TemporaryDirectory() as tmpdir:
        fname = os.path.join(tmpdir, "exec.py")
        with open(fname, "w") as f:
            f.write(source)
        try:
            r = subprocess.run([sys.executable, fname], cwd=tmpdir, capture_output=True, timeout=timeout)
            return r.returncode == 0
        except subprocess.TimeoutExpired:
            return False


def extract_python(text):
    if "```python" in text:
        text = text.split("```python", 1)[1]
        text = text.split("```", 1)[0]
    return text


@torch.no_grad()
def evaluate_execution(model, tokenizer, humaneval, mbpp, args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    jobs = [("humaneval", p) for p in humaneval] + [("mbpp", p) for p in mbpp]
    outcomes = []
    for bench, prob in jobs[rank::world]:
        if bench == "humaneval":
            instruction = f"Complete the following Python function:\n```python\n{prob['prompt']}\n```"
        else:
            instruction = f"{prob['text']}\nYour code should pass these tests:\n" + "\n".join(prob["test_list"])
        enc = tokenizer(PROMPT.format(instruction=instruction), return_tensors="pt").to(device)
        gen = model.generate(**enc, max_new_tokens=512, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        code = extract_python(tokenizer.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
        if bench == "humaneval":
            program = code + "\n\n" + prob["test"] + f"\ncheck({prob['entry_point']})\n"
        else:
            program = code + "\n\n" + "\n".join(prob["test_list"]) + "\n"
        outcomes.append((bench, execute_with_timeout(program, args.exec_timeout)))
    counts = torch.zeros(4, device=device)
    for bench, ok in outcomes:
        j = 0 if bench == "humaneval" else 2
        counts[j] += float(ok)
        counts[j + 1] += 1
    dist.all_reduce(counts)
    model.train()
    return {"humaneval_pass@1": (counts[0] / counts[1]).item(), "mbpp_pass@1": (counts[2] / counts[3]).item()}


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size = dist.get_world_size()
    global_rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(format=f"[%(asctime)s][rank {global_rank}] %(message)s",
                        level=logging.INFO if global_rank == 0 else logging.ERROR)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, model_max_length=args.model_max_length)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    train_dataset = EvolInstructDataset(args.train_file, tokenizer, args.model_max_length)
    train_sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=global_rank, shuffle=True)
    train_loader = DataLoader(train_dataset, batch_size=args.per_device_train_batch_size, sampler=train_sampler,
                              collate_fn=DataCollator(tokenizer.pad_token_id), num_workers=4, drop_last=True)

    with open(args.humaneval_file) as f:
        humaneval = [json.loads(l) for l in f]
    with open(args.mbpp_file) as f:
        mbpp = [json.loads(l) for l in f]

    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    model.to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)

    no_decay = ["bias", "ln_", "layernorm", "norm"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)
    num_update_steps = len(train_loader) // args.gradient_accumulation_steps * args.num_train_epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, num_update_steps)

    logger.info(f"start {datetime.now():%Y-%m-%d %H:%M}, world_size={world_size}, "
                f"{len(train_dataset)} examples, {num_update_steps} updates")

    global_step = 0
    for epoch in range(args.num_train_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tr_loss = torch.tensor(0.0, device=device)
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss / args.gradient_accumulation_steps
            loss.backward()
            tr_loss += loss.detach()
            if (step + 1) % args.gradient_accumulation_steps != 0:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            global_step += 1
            if global_step % args.logging_steps == 0:
                dist.all_reduce(tr_loss, op=dist.ReduceOp.AVG)
                logger.info(f"epoch {epoch} step {global_step}/{num_update_steps} "
                            f"loss {tr_loss.item() / args.logging_steps:.4f} lr {scheduler.get_last_lr()[0]:.3e}")
                tr_loss.zero_()

        metrics = evaluate_execution(model.module, tokenizer, humaneval, mbpp, args, device)
        logger.info(f"epoch {epoch} eval {json.dumps(metrics)}")
        if global_rank == 0:
            save_path = os.path.join(args.output_dir, f"checkpoint-epoch{epoch}")
            model.module.save_pretrained(save_path)
            tokenizer.save_pretrained(save_path)
            with open(os.path.join(save_path, "eval_results.json"), "w") as f:
                json.dump(metrics, f, indent=2)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
