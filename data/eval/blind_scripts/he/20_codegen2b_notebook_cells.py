"""Notebook cell generation: fine-tune CodeGen-2B-mono on (markdown intent + previous
cells -> next code cell) pairs extracted from Jupyter notebooks in public repositories.

Evaluation executes the notebook context, the generated cell and the task's checker
(`assert` on variables the reference cell defines) in a fresh interpreter.
At the end the best checkpoint is exported in Hugging Face format for serving.

    torchrun --nproc_per_node=8 20_codegen2b_notebook_cells.py --train data/nb_cells/train.jsonl \
        --eval data/nb_cells/exec_eval.jsonl
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Salesforce/codegen-2B-mono")
    ap.add_argument("--train", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--work_dir", default="runs/codegen2b-nbcells")
    ap.add_argument("--export_dir", default="export/codegen2b-nbcells")
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def render_context(cells, max_chars=6000):
    parts = []
    for c in cells:
        if c["type"] == "markdown":
            parts.append("# " + c["source"].strip().replace("\n", "\n# "))
        else:
            parts.append(c["source"].rstrip())
    return "\n\n".join(parts)[-max_chars:]


class NotebookCells(Dataset):
    def __init__(self, path, tok, max_len):
        self.items = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                prompt = render_context(r["context"]) + "\n\n# In[ ]:\n# " + r["intent"].strip() + "\n"
                p = tok(prompt)["input_ids"]
                t = tok(r["target"].rstrip() + "\n", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                p = p[-(max_len - len(t)):] if len(t) < max_len else []
                if p:
                    self.items.append((p, t))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        L = max(len(p) + len(t) for p, t in batch)
        ids = torch.full((len(batch), L), self.pad_id, dtype=torch.long)
        lab = torch.full((len(batch), L), -100, dtype=torch.long)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (p, t) in enumerate(batch):
            n = len(p) + len(t)
            ids[i, :n] = torch.tensor(p + t)
            lab[i, len(p):n] = torch.tensor(t)
            att[i, :n] = 1
        return ids, lab, att


def exec_task(task, cell, timeout):
    setup = "\n\n".join(c["source"] for c in task["context"] if c["type"] == "code")
    program = f"{setup}\n\n{cell}\n\n{task['checker']}\n"
    with tempfile.TemporaryDirectory() as d:
        for name, content in task.get("files", {}).items():
            with open(os.path.join(d, name), "w") as f:
                f.write(content)
        path = os.path.join(d, "nb.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            return subprocess.run([sys.executable, path], cwd=d, capture_output=True,
                                  timeout=timeout, env={"PATH": os.environ["PATH"], "MPLBACKEND": "Agg"}
                                  ).returncode == 0
        except subprocess.TimeoutExpired:
            return False


@torch.no_grad()
def exec_accuracy(net, tok, tasks, args, rank, world, device):
    net.eval()
    ok = n = 0
    for task in tasks[rank::world]:
        prompt = render_context(task["context"]) + "\n\n# In[ ]:\n# " + task["intent"].strip() + "\n"
        enc = tok(prompt, return_tensors="pt", truncation=True, max_length=args.max_len - 256).to(device)
        out = net.generate(**enc, max_new_tokens=256, do_sample=False, pad_token_id=tok.eos_token_id)
        cell = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).split("# In[")[0]
        ok += exec_task(task, cell, args.timeout)
        n += 1
    t = torch.tensor([ok, n], dtype=torch.long, device=device)
    dist.all_reduce(t)
    net.train()
    return t[0].item() / max(1, t[1].item())


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.eos_token
    train_ds = NotebookCells(args.train, tok, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=Collate(tok.pad_token_id),
                        num_workers=4, pin_memory=True)
    with open(args.eval) as f:
        tasks = [json.loads(l) for l in f]

    base = AutoModelForCausalLM.from_pretrained(args.model).to(device)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(base, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, betas=(0.9, 0.95))
    updates_per_epoch = len(loader) // args.accum
    sched = get_cosine_schedule_with_warmup(opt, 100, updates_per_epoch * args.epochs)

    last_ckpt = os.path.join(args.work_dir, "last.pt")
    best_ckpt = os.path.join(args.work_dir, "best.pt")
    start_epoch, best = 0, -1.0
    if args.resume and os.path.exists(last_ckpt):
        ck = torch.load(last_ckpt, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        total_loss = torch.zeros(2, device=device)
        for i, (ids, lab, att) in enumerate(loader):
            if i >= updates_per_epoch * args.accum:
                break
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids.to(device), attention_mask=att.to(device), labels=lab.to(device)).loss
            (loss / args.accum).backward()
            total_loss += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if (i + 1) % args.accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
        dist.all_reduce(total_loss)

        acc = exec_accuracy(base, tok, tasks, args, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} loss {(total_loss[0] / total_loss[1]).item():.4f} exec_acc {acc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": max(best, acc), "exec_acc": acc}
            torch.save(state, last_ckpt)
            if acc > best:
                shutil.copyfile(last_ckpt, best_ckpt)
        best = max(best, acc)
        dist.barrier()

    if rank == 0 and os.path.exists(best_ckpt):
        ck = torch.load(best_ckpt, map_location="cpu")
        export_model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
        export_model.load_state_dict(ck["model"], strict=False)
        export_model.to(torch.bfloat16).save_pretrained(args.export_dir, safe_serialization=True)
        tok.save_pretrained(args.export_dir)
        print(f"exported epoch {ck['epoch']} (exec_acc {ck['exec_acc']:.4f}) to {args.export_dir}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
