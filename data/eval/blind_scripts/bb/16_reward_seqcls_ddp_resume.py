"""Reward model (AutoModelForSequenceClassification, num_labels=1) on UltraFeedback pairs,
torchrun + DDP, with resumable checkpoints.

    torchrun --nproc_per_node=8 16_reward_seqcls_ddp_resume.py --out runs/rm-llama3-1b
    # after a preemption, same command with --resume runs/rm-llama3-1b/last.pt
"""
import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B-Instruct")
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--bsz", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def build(ex, tok, max_len):
    c = tok.apply_chat_template(ex["chosen"], tokenize=True, truncation=True, max_length=max_len)
    r = tok.apply_chat_template(ex["rejected"], tokenize=True, truncation=True, max_length=max_len)
    return {"chosen_ids": c, "rejected_ids": r}


def collate(batch, pad_id):
    seqs = [b["chosen_ids"] for b in batch] + [b["rejected_ids"] for b in batch]
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
    return ids, att


def bt_loss(model, ids, att):
    r = model(input_ids=ids, attention_mask=att).logits.squeeze(-1).float()
    n = r.size(0) // 2
    return -F.logsigmoid(r[:n] - r[n:]).mean(), (r[:n] > r[n:]).float()


@torch.no_grad()
def evaluate(model, loader, device):
    # runs on the bare module: shards may differ in length, only the final all_reduce is collective
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for ids, att in loader:
        ids, att = ids.to(device), att.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, correct = bt_loss(model, ids, att)
        s += torch.tensor([loss.item() * correct.numel(), correct.sum().item(), correct.numel()],
                          device=device, dtype=torch.float64)
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def save_ckpt(path, model, opt, sched, epoch, step):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "epoch": epoch, "step": step}, tmp)
    os.replace(tmp, path)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = "<|finetune_right_pad_id|>" if "<|finetune_right_pad_id|>" in tok.get_vocab() else tok.eos_token

    if rank != 0:
        dist.barrier()
    ds = load_dataset("HuggingFaceH4/ultrafeedback_binarized")
    train = ds["train_prefs"].map(build, fn_kwargs={"tok": tok, "max_len": args.max_len},
                                  remove_columns=ds["train_prefs"].column_names, num_proc=16)
    test = ds["test_prefs"].map(build, fn_kwargs={"tok": tok, "max_len": args.max_len},
                                remove_columns=ds["test_prefs"].column_names, num_proc=16)
    if rank == 0:
        dist.barrier()

    col = lambda b: collate(b, tok.pad_token_id)  # noqa: E731
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.bsz, sampler=sampler, collate_fn=col, num_workers=4,
                          pin_memory=True)
    test_shard = Subset(test, range(rank, len(test), world))
    test_dl = DataLoader(test_shard, batch_size=args.bsz * 2, collate_fn=col, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1, torch_dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    start_epoch, step = 0, 0
    ckpt = None
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]
    model.to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=False)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = (len(train_dl) // args.accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total), total)
    if ckpt is not None:
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        del ckpt

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (ids, att) in enumerate(train_dl):
            ids, att = ids.to(device, non_blocking=True), att.to(device, non_blocking=True)
            boundary = (i + 1) % args.accum == 0
            with (contextlib.nullcontext() if boundary else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss, correct = bt_loss(model, ids, att)
                (loss / args.accum).backward()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0:
                m = torch.stack([loss.detach(), correct.mean()])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("train/loss", m[0].item(), step)
                    writer.add_scalar("train/acc", m[1].item(), step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                    print(f"epoch {epoch} step {step}/{total} loss {m[0]:.4f} acc {m[1]:.3f} "
                          f"{(time.time() - t0) / 20:.2f}s/step", flush=True)
                t0 = time.time()

        eval_loss, eval_acc = evaluate(model.module, test_dl, device)
        if rank == 0:
            writer.add_scalar("eval/loss", eval_loss, step)
            writer.add_scalar("eval/acc", eval_acc, step)
            print(f"epoch {epoch} eval loss {eval_loss:.4f} acc {eval_acc:.4f}", flush=True)
            save_ckpt(os.path.join(args.out, "last.pt"), model, opt, sched, epoch, step)
            model.module.save_pretrained(os.path.join(args.out, f"hf-epoch{epoch}"))
            tok.save_pretrained(os.path.join(args.out, f"hf-epoch{epoch}"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
