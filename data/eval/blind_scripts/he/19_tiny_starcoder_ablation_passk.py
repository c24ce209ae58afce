"""Data-mixture ablations on tiny_starcoder_py: fine-tune on one mixture of repository
instruction sources and report HumanEval pass@{1,10,20} from 20 sampled completions per
problem (executed in a sandbox). Small model so that many mixtures can be compared.

    torchrun --nproc_per_node=8 19_tiny_starcoder_ablation_passk.py --mixture mixtures/docstrings_tests.yaml
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bigcode/tiny_starcoder_py")
    ap.add_argument("--mixture", required=True, help="yaml: list of {path, max_examples}")
    ap.add_argument("--humaneval", default="data/HumanEval.jsonl")
    ap.add_argument("--out", default="ablations")
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class Source(Dataset):
    def __init__(self, path, tok, seq_len, max_examples, seed):
        with open(path) as f:
            rows = [json.loads(l) for l in f]
        random.Random(seed).shuffle(rows)
        rows = rows[:max_examples] if max_examples else rows
        self.ex = []
        for r in rows:
            a = tok(r["prompt"])["input_ids"]
            b = tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            self.ex.append(((a + b)[:seq_len], len(a)))

    def __len__(self):
        return len(self.ex)

    def __getitem__(self, i):
        return self.ex[i]


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, b):
        L = max(len(x) for x, _ in b)
        ids = torch.full((len(b), L), self.pad_id, dtype=torch.long)
        lab = torch.full((len(b), L), -100, dtype=torch.long)
        att = torch.zeros((len(b), L), dtype=torch.long)
        for i, (x, n_p) in enumerate(b):
            ids[i, :len(x)] = torch.tensor(x)
            lab[i, n_p:len(x)] = torch.tensor(x[n_p:])
            att[i, :len(x)] = 1
        return ids, lab, att


def estimator(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))


def sandbox_exec(program, timeout):
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "candidate.py")
        with open(p, "w") as f:
            f.write(program)
        try:
            return subprocess.run([sys.executable, p], cwd=d, capture_output=True, timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False


def stop_at(text):
    for s in ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert"):
        i = text.find(s)
        if i >= 0:
            text = text[:i]
    return text


@torch.no_grad()
def humaneval_passk(model, tok, problems, args, rank, world, device):
    model.eval()
    torch.manual_seed(args.seed * 1000 + rank)
    correct = []
    for prob in problems[rank::world]:
        enc = tok(prob["prompt"], return_tensors="pt").to(device)
        out = model.generate(**enc, do_sample=True, temperature=args.temperature, top_p=0.95,
                             num_return_sequences=args.n, max_new_tokens=300, pad_token_id=tok.eos_token_id)
        c = 0
        for t in tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True):
            c += sandbox_exec(prob["prompt"] + stop_at(t) + "\n\n" + prob["test"]
                              + f"\ncheck({prob['entry_point']})\n", args.timeout)
        correct.append(c)
    local = torch.tensor(correct, dtype=torch.long, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    all_correct = torch.cat(gathered).tolist()
    model.train()
    return {f"pass@{k}": float(np.mean([estimator(args.n, c, k) for c in all_correct])) for k in (1, 10, 20)}


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    with open(args.mixture) as f:
        mixture = yaml.safe_load(f)
    tok = AutoTokenizer.from_pretrained(args.model)
    sources = [Source(m["path"], tok, args.seq_len, m.get("max_examples"), args.seed) for m in mixture["sources"]]
    train = ConcatDataset(sources)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.bs, sampler=sampler, collate_fn=Collate(tok.eos_token_id),
                        num_workers=4, pin_memory=True)
    with open(args.humaneval) as f:
        problems = [json.loads(l) for l in f]

    model = AutoModelForCausalLM.from_pretrained(args.model).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(loader) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, total // 20, total)

    name = os.path.splitext(os.path.basename(args.mixture))[0]
    out_dir = os.path.join(args.out, name)
    history = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        s = torch.zeros(2, device=device)
        for ids, lab, att in loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(input_ids=ids.to(device), attention_mask=att.to(device), labels=lab.to(device)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            s += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(s)
        metrics = humaneval_passk(model, tok, problems, args, rank, world, device)
        metrics.update(epoch=epoch, train_loss=(s[0] / s[1]).item())
        history.append(metrics)
        if rank == 0:
            print(json.dumps(metrics), flush=True)

    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        model.save_pretrained(os.path.join(out_dir, "model"))
        with open(os.path.join(out_dir, "history.json"), "w") as f:
            json.dump({"mixture": mixture, "args": vars(args), "history": history}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
