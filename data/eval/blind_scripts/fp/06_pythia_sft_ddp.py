"""Supervised fine-tuning of a Pythia-1.4B model on instruction data (jsonl).

One node, 8 GPUs, DDP. Launch:
    torchrun --nnodes=1 --nproc-per-node=8 --max-restarts=3 \
        --rdzv-backend=c10d --rdzv-endpoint=localhost:29400 06_pythia_sft_ddp.py --data sft.jsonl
The job checkpoints every N steps and on SIGTERM, and resumes automatically.
"""
import argparse
import json
import os
import random
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_constant_schedule_with_warmup

PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
_sigterm_seen = False


def _handler(signum, frame):
    global _sigterm_seen
    _sigterm_seen = True


class SFTDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        prompt = PROMPT.format(instruction=row["instruction"])
        p_ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        r_ids = self.tok(row["response"] + self.tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p_ids + r_ids)[: self.max_len]
        labels = ([-100] * len(p_ids) + r_ids)[: self.max_len]
        return torch.tensor(ids), torch.tensor(labels)


def pad_collate(pad_id):
    def fn(batch):
        n = max(len(x) for x, _ in batch)
        ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), n), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, : len(x)] = x
            labels[i, : len(y)] = y
            mask[i, : len(x)] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    return fn


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="EleutherAI/pythia-1.4b")
    p.add_argument("--out", default="/fsx/sft/pythia-1.4b")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--micro-bs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5, help="global batch 8 GPUs x 4 = 32")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--ckpt-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = parse()
    signal.signal(signal.SIGTERM, _handler)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.eos_token
    ds = SFTDataset(args.data, tok, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, collate_fn=pad_collate(tok.pad_token_id),
                        num_workers=2, pin_memory=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).to(dev)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = get_constant_schedule_with_warmup(optim, args.warmup)

    ckpt_file = os.path.join(args.out, "checkpoint.pt")
    epoch0, skip, step = 0, 0, 0
    if os.path.exists(ckpt_file):
        ckpt = torch.load(ckpt_file)
        model.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        epoch0, skip, step = ckpt["epoch"], ckpt["batch"], ckpt["step"]
        del ckpt
        if rank == 0:
            print(f"[resume] epoch={epoch0} batch={skip} step={step}", flush=True)

    model = DDP(model, device_ids=[local_rank])

    def checkpoint(epoch, batch):
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            tmp = ckpt_file + ".tmp"
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "batch": batch, "step": step}, tmp)
            os.replace(tmp, ckpt_file)
        dist.barrier()

    model.train()
    stop_t = torch.zeros((), device=dev)
    for epoch in range(epoch0, args.epochs):
        sampler.set_epoch(epoch)
        tokens_seen = torch.zeros((), device=dev)
        t0 = time.time()
        for b, batch in enumerate(loader):
            if epoch == epoch0 and b < skip:
                continue
            batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += batch["attention_mask"].sum()

            if step % 10 == 0:
                logged = torch.stack([loss.detach(), tokens_seen])
                dist.all_reduce(logged)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {logged[0].item() / world:.4f} "
                          f"tok/s {logged[1].item() / (time.time() - t0):.0f}", flush=True)

            stop_t.fill_(float(_sigterm_seen))
            dist.all_reduce(stop_t, op=dist.ReduceOp.MAX)
            if stop_t.item() > 0 or step % args.ckpt_every == 0:
                checkpoint(epoch, b + 1)
            if stop_t.item() > 0:
                if rank == 0:
                    print("SIGTERM: saved and exiting", flush=True)
                dist.destroy_process_group()
                return
        checkpoint(epoch + 1, 0)

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"), safe_serialization=True)
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
