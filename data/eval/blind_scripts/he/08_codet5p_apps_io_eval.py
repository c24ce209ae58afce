"""CodeT5+ (220M, Python) fine-tuning for problem-statement -> program generation.

Training data: competitive-programming style problems scraped from solution repositories
(problem statement, accepted Python solution). Evaluation runs the generated programs
on the problems' stdin/stdout test cases ("strict accuracy" = all cases pass).

    torchrun --nproc_per_node=4 08_codet5p_apps_io_eval.py --train data/repo_cp/train.jsonl \
        --eval data/repo_cp/intro_test.jsonl
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, get_linear_schedule_with_warmup


def options():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Salesforce/codet5p-220m-py")
    ap.add_argument("--train", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--save_dir", default="saved/codet5p_cp")
    ap.add_argument("--src_len", type=int, default=600)
    ap.add_argument("--tgt_len", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--beams", type=int, default=1)
    ap.add_argument("--eval_limit", type=int, default=500)
    ap.add_argument("--case_timeout", type=float, default=4.0)
    return ap.parse_args()


def format_source(problem):
    src = "QUESTION:\n" + problem["question"].strip()
    if problem.get("starter_code"):
        src += "\n" + problem["starter_code"]
    return src + "\nANSWER:\n"


class ProblemSolutions(Dataset):
    def __init__(self, path, tok, src_len, tgt_len):
        self.tok, self.src_len, self.tgt_len = tok, src_len, tgt_len
        self.pairs = []
        with open(path) as f:
            for line in f:
                p = json.loads(line)
                for sol in p["solutions"][:5]:
                    self.pairs.append((format_source(p), sol))

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        src, tgt = self.pairs[i]
        s = self.tok(src, max_length=self.src_len, truncation=True)["input_ids"]
        t = self.tok(tgt, max_length=self.tgt_len, truncation=True)["input_ids"]
        return s, t


class Seq2SeqCollator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        S = max(len(s) for s, _ in batch)
        T = max(len(t) for _, t in batch)
        src = torch.full((len(batch), S), self.pad_id, dtype=torch.long)
        tgt = torch.full((len(batch), T), -100, dtype=torch.long)
        for i, (s, t) in enumerate(batch):
            src[i, :len(s)] = torch.tensor(s)
            tgt[i, :len(t)] = torch.tensor(t)
        return src, src.ne(self.pad_id).long(), tgt


def run_io_case(program, stdin, expected, timeout):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "sol.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            res = subprocess.run([sys.executable, path], input=stdin, capture_output=True, text=True,
                                 cwd=d, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        if res.returncode != 0:
            return False
        return res.stdout.split() == expected.split()


def solves(program, io, timeout):
    for stdin, expected in zip(io["inputs"], io["outputs"]):
        if not run_io_case(program, stdin, expected, timeout):
            return False
    return True


@torch.no_grad()
def strict_accuracy(model, tok, problems, args, rank, world, device):
    model.eval()
    solved = []
    for prob in problems[rank::world]:
        enc = tok(format_source(prob), max_length=args.src_len, truncation=True, return_tensors="pt").to(device)
        outputs = model.generate(**enc, max_length=args.tgt_len, num_beams=args.beams, early_stopping=True)
        program = tok.decode(outputs[0], skip_special_tokens=True)
        solved.append((prob["problem_id"], solves(program, json.loads(prob["input_output"]), args.case_timeout)))
    gathered = [None] * world
    dist.all_gather_object(gathered, solved)
    model.train()
    merged = dict(x for part in gathered for x in part)
    return sum(merged.values()) / len(merged)


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    train_set = ProblemSolutions(args.train, tok, args.src_len, args.tgt_len)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        collate_fn=Seq2SeqCollator(tok.pad_token_id), pin_memory=True)
    with open(args.eval) as f:
        eval_problems = [json.loads(l) for l in f][: args.eval_limit]

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = get_linear_schedule_with_warmup(optim, args.warmup, len(loader) * args.epochs)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"{len(train_set)} training pairs, {len(eval_problems)} eval problems, {world} GPUs")

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run_loss = torch.zeros(2, device=device)
        for step, (src, src_mask, tgt) in enumerate(loader):
            src, src_mask, tgt = src.to(device), src_mask.to(device), tgt.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=src, attention_mask=src_mask, labels=tgt).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            run_loss += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(run_loss)

        acc = strict_accuracy(model, tok, eval_problems, args, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} loss {(run_loss[0] / run_loss[1]).item():.4f} strict_acc {acc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if acc > best:
                best = acc
                model.module.save_pretrained(os.path.join(args.save_dir, "best"))
                tok.save_pretrained(os.path.join(args.save_dir, "best"))
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(args.save_dir, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
