"""Fine-tune CodeGen-2B-mono on an in-house Python corpus, with step checkpoints and resume.

Node: 8x A100-80G.  torchrun --nproc_per_node=8 10_codegen2b_resume_ckpt.py --corpus /datasets/inhouse_py
"""
import argparse
import glob
import logging
import math
import os
import re
import shutil

import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

log = logging.getLogger(__name__)


def cli():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Salesforce/codegen-2B-mono")
    parser.add_argument("--corpus", required=True, help="load_from_disk dataset with packed 'input_ids' (train/validation)")
    parser.add_argument("--output_dir", default="/checkpoints/codegen2b-inhouse")
    parser.add_argument("--micro_batch", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ckpt_every", type=int, default=500)
    parser.add_argument("--keep_last", type=int, default=3)
    parser.add_argument("--eval_every", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args()


def latest_checkpoint(out_dir):
    ckpts = glob.glob(os.path.join(out_dir, "checkpoint-*"))
    if not ckpts:
        return None
    return max(ckpts, key=lambda p: int(re.findall(r"checkpoint-(\d+)", p)[0]))


def rotate_checkpoints(out_dir, keep):
    ckpts = sorted(glob.glob(os.path.join(out_dir, "checkpoint-*")),
                   key=lambda p: int(re.findall(r"checkpoint-(\d+)", p)[0]))
    for old in ckpts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(model, tokenizer, optimizer, scheduler, step, epoch, args):
    ckpt_dir = os.path.join(args.output_dir, f"checkpoint-{step}")
    os.makedirs(ckpt_dir, exist_ok=True)
    model.module.save_pretrained(ckpt_dir)
    tokenizer.save_pretrained(ckpt_dir)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "step": step, "epoch": epoch}, os.path.join(ckpt_dir, "training_state.pt"))
    rotate_checkpoints(args.output_dir, args.keep_last)
    log.info("saved %s", ckpt_dir)


@torch.no_grad()
def validate(raw_model, val_set, rank, world, device, bs):
    raw_model.eval()
    tot = torch.zeros(2, device=device)
    idx = list(range(rank, len(val_set), world))
    for s in range(0, len(idx), bs):
        x = torch.tensor(val_set[idx[s : s + bs]]["input_ids"], device=device)
        loss = raw_model(input_ids=x, labels=x).loss
        tot += torch.stack([loss.float() * x.size(0), torch.tensor(float(x.size(0)), device=device)])
    dist.all_reduce(tot)
    raw_model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(args.seed)

    ds = load_from_disk(args.corpus).with_format("torch", columns=["input_ids"])
    train_set, val_set = ds["train"], ds["validation"].with_format(None)
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.micro_batch, sampler=sampler, num_workers=4, pin_memory=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    resume = latest_checkpoint(args.output_dir)
    state = None
    if resume is not None:
        log.info("resuming from %s", resume)
        model = AutoModelForCausalLM.from_pretrained(resume, torch_dtype=torch.bfloat16)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        state = torch.load(os.path.join(resume, "training_state.pt"), map_location="cpu")

    model = DDP(model.to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    updates_per_epoch = len(loader) // args.accumulate
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, total_updates)

    step, start_epoch = 0, 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, start_epoch = state["step"], state["epoch"]
        del state

    skip_updates = step - start_epoch * updates_per_epoch
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(loader):
            if epoch == start_epoch and i < skip_updates * args.accumulate:
                continue
            x = batch["input_ids"].to(device, non_blocking=True)
            do_sync = (i + 1) % args.accumulate == 0
            model.require_backward_grad_sync = do_sync
            loss = model(input_ids=x, labels=x).loss
            (loss / args.accumulate).backward()
            if not do_sync:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 25 == 0:
                log.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, total_updates, loss.item(),
                         scheduler.get_last_lr()[0])
            if step % args.eval_every == 0:
                vl = validate(model.module, val_set, rank, world, device, args.micro_batch)
                log.info("step %d val_loss %.4f ppl %.2f", step, vl, math.exp(vl))
            if step % args.ckpt_every == 0:
                save_checkpoint(model, tokenizer, optimizer, scheduler, step, epoch, args)
                dist.barrier()

    vl = validate(model.module, val_set, rank, world, device, args.micro_batch)
    log.info("final val_loss %.4f", vl)
    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
