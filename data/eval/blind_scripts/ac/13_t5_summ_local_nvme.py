"""Flan-T5-base fine-tuning for maintenance-report summarisation.

Checkpoints go to the node's local NVMe while training (Lustre chokes on the
frequent 1 GB writes) and are copied to /project at the end of the job.

#!/bin/bash
#SBATCH --job-name=t5-summ
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --mem=200G
#SBATCH --time=10:00:00
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun bash -c 'torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 --node_rank=$SLURM_NODEID \
    --master_addr=$MASTER_ADDR --master_port=29600 train_t5_summ.py \
    --data /project/reports/summ_v2 --final-dir /project/reports/models/t5-summ-$SLURM_JOB_ID'
"""
import argparse
import json
import os
import shutil
import time

import evaluate
import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, get_linear_schedule_with_warmup


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="load_from_disk dir with train/validation/test")
    p.add_argument("--model", default="google/flan-t5-base")
    p.add_argument("--work-dir", default=os.path.join("/local/nvme", os.environ.get("USER", "user"),
                                                      os.environ.get("SLURM_JOB_ID", "dev")))
    p.add_argument("--final-dir", required=True)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--global-bs", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-src", type=int, default=768)
    p.add_argument("--max-tgt", type=int, default=128)
    return p.parse_args()


def encode(batch, tok, args):
    enc = tok(["summarize: " + t for t in batch["report"]], max_length=args.max_src, truncation=True)
    enc["labels"] = tok(text_target=batch["summary"], max_length=args.max_tgt, truncation=True)["input_ids"]
    return enc


@torch.no_grad()
def rouge_eval(model, ds, tok, collator, args, rank, world, device):
    """Generate on a strided slice of ds, gather the strings on every rank, score on rank 0."""
    model.eval()
    shard = Subset(ds, range(rank, len(ds), world))
    dl = DataLoader(shard, batch_size=32, collate_fn=collator)
    preds, refs = [], []
    for batch in dl:
        labels = batch.pop("labels")
        out = model.generate(input_ids=batch["input_ids"].to(device),
                             attention_mask=batch["attention_mask"].to(device),
                             max_new_tokens=args.max_tgt, num_beams=4)
        preds += tok.batch_decode(out, skip_special_tokens=True)
        labels[labels == -100] = tok.pad_token_id
        refs += tok.batch_decode(labels, skip_special_tokens=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, (preds, refs))
    model.train()
    if rank != 0:
        return None
    all_p = [p for g in gathered for p in g[0]]
    all_r = [r for g in gathered for r in g[1]]
    return evaluate.load("rouge").compute(predictions=all_p, references=all_r)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.model)
    raw = load_from_disk(args.data)
    cols = raw["train"].column_names
    ds = raw.map(lambda b: encode(b, tok, args), batched=True, remove_columns=cols, keep_in_memory=True)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).to(device)
    collator = DataCollatorForSeq2Seq(tok, model=model, padding="longest")

    per_gpu = args.global_bs // world
    sampler = DistributedSampler(ds["train"], shuffle=True, drop_last=True)
    train_dl = DataLoader(ds["train"], batch_size=per_gpu, sampler=sampler, collate_fn=collator,
                          num_workers=4, pin_memory=True, drop_last=True)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.05 * total), total)

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        print(f"world {world}, {len(train_dl)} steps/epoch, work dir {args.work_dir}", flush=True)
    best_path = os.path.join(args.work_dir, "best.pt")
    best_rl = -1.0

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        scores = rouge_eval(model.module, ds["validation"], tok, collator, args, rank, world, device)
        if rank == 0:
            rl = scores["rougeL"]
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} rougeL {rl:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if rl > best_rl:
                best_rl = rl
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "rougeL": rl}, best_path)
        dist.barrier()

    # test with the best checkpoint rather than the last epoch
    state = torch.load(best_path, map_location=device)
    model.module.load_state_dict(state["model"])
    test = rouge_eval(model.module, ds["test"], tok, collator, args, rank, world, device)
    if rank == 0:
        print(f"test (best epoch {state['epoch']}): {test}", flush=True)
        with open(os.path.join(args.work_dir, "test_metrics.json"), "w") as fh:
            json.dump({k: float(v) for k, v in test.items()}, fh, indent=2)
        model.module.save_pretrained(os.path.join(args.work_dir, "hf"))
        tok.save_pretrained(os.path.join(args.work_dir, "hf"))
        shutil.copytree(args.work_dir, args.final_dir, dirs_exist_ok=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
