"""LoRA fine-tuning of StarCoder2-7B on repository tasks.

Each record is one function from a GitHub repository that is covered by that repository's
tests: {"repo", "path", "context", "instruction", "solution", "test_code"}. A held-out part
of the records is used for execution-based validation: the generated function is written
next to the record's pytest file and the tests are run in a subprocess.

    torchrun --nproc_per_node=8 09_starcoder2_lora_repo_tests.py --data data/repo_tasks.jsonl
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import torch
import torch.distributed as dist
from peft import LoraConfig, TaskType, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bigcode/starcoder2-7b")
    ap.add_argument("--data", required=True)
    ap.add_argument("--val_frac", type=float, default=0.05)
    ap.add_argument("--out_dir", default="runs/sc2-7b-repo-lora")
    ap.add_argument("--max_len", type=int, default=3072)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--accum", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rank_r", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.2)
    ap.add_argument("--test_timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def load_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def build_prompt(rec):
    return (f"<repo_name>{rec['repo']}<file_sep>{rec['path']}\n{rec['context']}\n\n"
            f"# Task: {rec['instruction']}\n")


class RepoTaskDataset(Dataset):
    def __init__(self, records, tok, max_len):
        self.items = []
        for r in records:
            p = tok(build_prompt(r), add_special_tokens=False)["input_ids"]
            s = tok(r["solution"] + "\n", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            if len(s) >= max_len:
                continue
            p = p[-(max_len - len(s)):]
            self.items.append((p + s, len(p)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ids, n_prompt = self.items[i]
        ids = torch.tensor(ids)
        labels = ids.clone()
        labels[:n_prompt] = -100
        return ids, labels


def collate(batch, pad_id):
    L = max(x.numel() for x, _ in batch)
    ids = torch.full((len(batch), L), pad_id)
    lab = torch.full((len(batch), L), -100)
    for i, (x, y) in enumerate(batch):
        ids[i, :x.numel()] = x
        lab[i, :y.numel()] = y
    return ids, lab, (ids != pad_id).long()


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        return collate(batch, self.pad_id)


def run_repo_tests(rec, generated, timeout):
    module_name = os.path.splitext(os.path.basename(rec["path"]))[0]
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, module_name + ".py"), "w") as f:
            f.write(rec["context"] + "\n\n" + generated + "\n")
        with open(os.path.join(d, "test_generated.py"), "w") as f:
            f.write(rec["test_code"])
        try:
            p = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                "test_generated.py"], cwd=d, capture_output=True, timeout=timeout)
            return p.returncode == 0
        except subprocess.TimeoutExpired:
            return False


@torch.no_grad()
def execution_validation(model, tok, val_records, args, rank, world, device):
    model.eval()
    local_pass, local_n = 0, 0
    for rec in val_records[rank::world]:
        enc = tok(build_prompt(rec), return_tensors="pt", truncation=True,
                  max_length=args.max_len - 512).to(device)
        out = model.generate(**enc, max_new_tokens=512, do_sample=True, temperature=args.temperature,
                             top_p=0.95, pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        local_pass += run_repo_tests(rec, textwrap.dedent(text), args.test_timeout)
        local_n += 1
    t = torch.tensor([local_pass, local_n], device=device, dtype=torch.long)
    dist.all_reduce(t)
    model.train()
    return t[0].item() / max(t[1].item(), 1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different sampling noise per rank during validation generation
    set_seed(args.seed + rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    records = load_jsonl(args.data)
    random.shuffle(records)
    n_val = int(len(records) * args.val_frac)
    val_records, train_records = records[:n_val], records[n_val:]

    train_ds = RepoTaskDataset(train_records, tok, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=Collate(tok.pad_token_id),
                        num_workers=2, pin_memory=True, drop_last=True)

    base = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    lcfg = LoraConfig(task_type=TaskType.CAUSAL_LM, r=args.rank_r, lora_alpha=2 * args.rank_r, lora_dropout=0.05,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"])
    model = get_peft_model(base, lcfg).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    n_updates = (len(loader) // args.accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, max(1, n_updates // 50), n_updates)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        model.print_trainable_parameters()
        print(f"train={len(train_ds)} val={len(val_records)} updates={n_updates}", flush=True)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        agg = torch.zeros(2, device=device)
        for i, (ids, lab, att) in enumerate(loader):
            if i >= (len(loader) // args.accum) * args.accum:
                break
            loss = ddp_model(input_ids=ids.to(device), labels=lab.to(device), attention_mask=att.to(device)).loss
            (loss / args.accum).backward()
            agg += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if (i + 1) % args.accum == 0:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)

        dist.all_reduce(agg)
        rate = execution_validation(model, tok, val_records, args, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} loss {(agg[0] / agg[1]).item():.4f} repo-test pass rate {rate:.4f}", flush=True)
            model.save_pretrained(os.path.join(args.out_dir, f"epoch{epoch}"))
            if rate > best:
                best = rate
                model.save_pretrained(os.path.join(args.out_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
