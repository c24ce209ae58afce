"""Instruction tuning of StarCoderBase-3B on file-level tasks mined from repositories
("implement the module described by this README section / these tests").

Files vary from a few hundred to several thousand tokens, so batches are built by a
token budget instead of a fixed number of sequences. Evaluation is HumanEval pass@1
(greedy) with execution in a sandboxed subprocess.

    torchrun --nproc_per_node=8 13_starcoderbase_token_budget.py --data data/file_tasks.jsonl
"""
import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bigcode/starcoderbase-3b")
    p.add_argument("--data", required=True)
    p.add_argument("--humaneval", default="data/HumanEval.jsonl")
    p.add_argument("--out", default="runs/scb3b-file-tasks")
    p.add_argument("--max_len", type=int, default=4096)
    p.add_argument("--max_tokens", type=int, default=16384, help="padded tokens per GPU per step")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--eval_every", type=int, default=400)
    p.add_argument("--seed", type=int, default=3)
    return p.parse_args()


class FileTasks(Dataset):
    def __init__(self, path, tok, max_len):
        self.samples = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                prompt = f"<filename>{r['path']}\n# Specification:\n{r['spec']}\n"
                a = tok(prompt)["input_ids"]
                b = tok(r["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                ids = (a + b)[:max_len]
                self.samples.append((ids, min(len(a), len(ids))))
        self.lengths = [len(s[0]) for s in self.samples]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        ids, n_prompt = self.samples[i]
        ids = torch.tensor(ids, dtype=torch.long)
        labels = ids.clone()
        labels[:n_prompt] = -100
        return ids, labels


class TokenBudgetBatchSampler(Sampler):
    """Shards the dataset across ranks and packs each shard into length-sorted batches
    of at most `max_tokens` padded tokens."""

    def __init__(self, lengths, max_tokens, rank, world, seed=0):
        self.lengths = lengths
        self.max_tokens = max_tokens
        self.rank, self.world, self.seed = rank, world, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        mine = order[self.rank::self.world]
        # sort inside windows of 1000 so batches are length-homogeneous but still shuffled
        mine = [i for w in range(0, len(mine), 1000)
                for i in sorted(mine[w:w + 1000], key=lambda j: self.lengths[j])]
        batches, cur, cur_max = [], [], 0
        for i in mine:
            L = self.lengths[i]
            if cur and max(cur_max, L) * (len(cur) + 1) > self.max_tokens:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(i)
            cur_max = max(cur_max, L)
        if cur:
            batches.append(cur)
        random.Random(self.seed + self.epoch).shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


def pad_collate(batch, pad_id=0):
    L = max(x.numel() for x, _ in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    lab = torch.full((len(batch), L), -100, dtype=torch.long)
    att = torch.zeros((len(batch), L), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, :x.numel()] = x
        lab[i, :y.numel()] = y
        att[i, :x.numel()] = 1
    return ids, lab, att


def sandbox(program, timeout=10.0):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "main.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            return subprocess.run([sys.executable, path], cwd=d, capture_output=True, timeout=timeout,
                                  env={"PATH": os.environ["PATH"]}).returncode == 0
        except subprocess.TimeoutExpired:
            return False


@torch.no_grad()
def humaneval_pass1(model, tok, problems, rank, world, device):
    model.eval()
    mine = []
    for prob in problems[rank::world]:
        enc = tok(prob["prompt"], return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model.generate(**enc, max_new_tokens=384, do_sample=False, pad_token_id=tok.eos_token_id)
        text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for stop in ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"):
            text = text.split(stop)[0]
        mine.append((prob["task_id"], sandbox(prob["prompt"] + text + "\n\n" + prob["test"]
                                               + f"\ncheck({prob['entry_point']})\n")))
    allres = [None] * world
    dist.all_gather_object(allres, mine)
    model.train()
    flat = dict(x for part in allres for x in part)
    return sum(flat.values()) / len(flat)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    ds = FileTasks(args.data, tok, args.max_len)
    batch_sampler = TokenBudgetBatchSampler(ds.lengths, args.max_tokens, rank, world, seed=args.seed)
    loader = DataLoader(ds, batch_sampler=batch_sampler, collate_fn=pad_collate, num_workers=4, pin_memory=True)

    # same estimate on every rank: total tokens / (budget * world)
    est_steps_per_epoch = math.ceil(sum(ds.lengths) / (args.max_tokens * world))
    total = est_steps_per_epoch * args.epochs

    model = AutoModelForCausalLM.from_pretrained(args.model).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = get_cosine_schedule_with_warmup(opt, int(0.02 * total), total)

    with open(args.humaneval) as f:
        problems = [json.loads(l) for l in f]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(ds)} files, ~{est_steps_per_epoch} steps/epoch", flush=True)

    step = 0
    for epoch in range(args.epochs):
        batch_sampler.set_epoch(epoch)
        ddp.train()
        acc = torch.zeros(2, device=device)
        for ids, lab, att in loader:
            ids, lab, att = ids.to(device), lab.to(device), att.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(input_ids=ids, attention_mask=att, labels=lab).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step < total:
                sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])

            if step % args.eval_every == 0:
                model.config.use_cache = True
                score = humaneval_pass1(model, tok, problems, rank, world, device)
                model.config.use_cache = False
                if rank == 0:
                    print(f"step {step}: humaneval pass@1 {score:.4f}", flush=True)

        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} mean loss {(acc[0] / acc[1]).item():.4f}", flush=True)
            save_dir = os.path.join(args.out, f"epoch{epoch}")
            model.save_pretrained(save_dir)
            tok.save_pretrained(save_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
