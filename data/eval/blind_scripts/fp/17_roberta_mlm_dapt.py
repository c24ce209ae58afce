"""Domain-adaptive MLM pretraining (DAPT) of RoBERTa-base on clinical notes.

    torchrun --nnodes=1 --nproc-per-node=8 --max-restarts=3 \
        --rdzv-backend=c10d --rdzv-endpoint=localhost:29400 \
        17_roberta_mlm_dapt.py --exp-root /shared/dapt --tokenized /shared/data/notes_tok

Every run lives in <exp-root>/<timestamp>/. After a restart the newest unfinished
run directory is picked up again, so torchrun's restarts continue the same run.
"""
import argparse
import glob
import math
import os
import signal
import time

import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling,
                          get_linear_schedule_with_warmup)

TERM = {"seen": False}


def on_term(signum, frame):
    TERM["seen"] = True


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--exp-root", required=True)
    ap.add_argument("--tokenized", required=True, help="save_to_disk output with 'train'/'validation'")
    ap.add_argument("--model", default="roberta-base")
    ap.add_argument("--bs", type=int, default=32, help="per GPU")
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4, help="for bs 32 x 8 GPUs x accum 8 = 2048")
    ap.add_argument("--max-updates", type=int, default=12500)
    ap.add_argument("--warmup", type=int, default=750)
    ap.add_argument("--ckpt-every", type=int, default=250)
    ap.add_argument("--eval-every", type=int, default=1000)
    return ap.parse_args()


def pick_run_dir(exp_root):
    """Newest run without a DONE marker, or a fresh timestamped directory."""
    runs = sorted(glob.glob(os.path.join(exp_root, "run_*")))
    for d in reversed(runs):
        if not os.path.exists(os.path.join(d, "DONE")):
            return d
    d = os.path.join(exp_root, time.strftime("run_%Y%m%d_%H%M%S"))
    os.makedirs(d, exist_ok=True)
    return d


@torch.no_grad()
def evaluate(model, loader, device, limit=300):
    model.eval()
    acc = torch.zeros(2, device=device)
    for i, batch in enumerate(loader):
        if i == limit:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        n = (batch["labels"] != -100).sum()
        acc += torch.stack([out.loss.float() * n, n.float()])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    signal.signal(signal.SIGTERM, on_term)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    # rank 0 decides which run directory this job uses and tells everyone else
    holder = [pick_run_dir(args.exp_root) if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    run_dir = holder[0]

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    tok = AutoTokenizer.from_pretrained(args.model)
    data = load_from_disk(args.tokenized)
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15)
    sampler = DistributedSampler(data["train"], shuffle=True, seed=42, drop_last=True)
    val_loader = DataLoader(data["validation"], batch_size=args.bs, collate_fn=collator,
                            sampler=DistributedSampler(data["validation"], shuffle=False, drop_last=True))

    model = AutoModelForMaskedLM.from_pretrained(args.model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup, args.max_updates)

    update, epoch, micro_in_epoch = 0, 0, 0
    ckpt_file = os.path.join(run_dir, "trainer_state.pt")
    if os.path.exists(ckpt_file):
        st = torch.load(ckpt_file, map_location="cpu")
        model.load_state_dict(st["model"])
        optimizer.load_state_dict(st["optimizer"])
        scheduler.load_state_dict(st["scheduler"])
        update, epoch, micro_in_epoch = st["update"], st["epoch"], st["micro_in_epoch"]
        torch.manual_seed(42 + update)
        if rank == 0:
            print(f"continuing {run_dir} at update {update}", flush=True)

    model = DDP(model, device_ids=[local_rank])

    def save():
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "update": update, "epoch": epoch,
                        "micro_in_epoch": micro_in_epoch}, ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()

    model.train()
    flag = torch.zeros(1, device=device)
    finished = False
    while not finished:
        sampler.set_epoch(epoch)
        loader = DataLoader(data["train"], batch_size=args.bs, sampler=sampler, collate_fn=collator,
                            num_workers=4, pin_memory=True, drop_last=True)
        usable = len(loader) - len(loader) % args.accum
        t0 = time.time()
        for i, batch in enumerate(loader):
            if i < micro_in_epoch:
                continue
            if i >= usable:
                break
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            boundary = (i + 1) % args.accum == 0
            if boundary:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.accum
                loss.backward()
            else:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(**batch).loss / args.accum
                    loss.backward()
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1
            micro_in_epoch = i + 1

            if rank == 0 and update % 20 == 0:
                print(f"update {update} loss {loss.item() * args.accum:.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 20:.2f}s/update", flush=True)
                t0 = time.time()

            flag.fill_(float(TERM["seen"]))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() or update % args.ckpt_every == 0 or update == args.max_updates:
                save()
            if update % args.eval_every == 0:
                vl = evaluate(model, val_loader, device)
                if rank == 0:
                    print(f"update {update} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            if flag.item() or update >= args.max_updates:
                finished = True
                break
        else:
            epoch += 1
            micro_in_epoch = 0
            continue
        if not finished:
            epoch += 1
            micro_in_epoch = 0

    if rank == 0 and update >= args.max_updates:
        model.module.save_pretrained(os.path.join(run_dir, "hf_model"))
        tok.save_pretrained(os.path.join(run_dir, "hf_model"))
        open(os.path.join(run_dir, "DONE"), "w").close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
