"""
DPO on argilla/dpo-mix-7k with plain torch DDP (no TRL), bf16, gradient
checkpointing and a frozen reference model on every GPU.

    torchrun --standalone --nproc_per_node=8 08_dpo_mix7k_ddp.py \
        --model HuggingFaceTB/SmolLM2-1.7B-Instruct --output_dir runs/dpo_smol
"""
import argparse
import glob
import math
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-1.7B-Instruct")
    ap.add_argument("--output_dir", default="runs/dpo_smol")
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--label_smoothing", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=5e-7)
    ap.add_argument("--batch_size", type=int, default=4, help="pairs per GPU per micro step")
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--save_steps", type=int, default=100)
    ap.add_argument("--keep_last", type=int, default=2)
    return ap.parse_args()


class PairCollator:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def encode(self, messages):
        prompt = self.tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        full = self.tok.apply_chat_template(messages, tokenize=False)
        p_len = len(self.tok(prompt, add_special_tokens=False).input_ids)
        ids = self.tok(full, add_special_tokens=False).input_ids[: self.max_len]
        labels = [-100] * min(p_len, len(ids)) + ids[p_len:]
        return ids, labels

    def __call__(self, rows):
        enc = [self.encode(r["chosen"]) for r in rows] + [self.encode(r["rejected"]) for r in rows]
        L = max(len(i) for i, _ in enc)
        pad = self.tok.pad_token_id
        ids = torch.tensor([i + [pad] * (L - len(i)) for i, _ in enc])
        labels = torch.tensor([l + [-100] * (L - len(l)) for _, l in enc])
        attn = (torch.arange(L)[None, :] < torch.tensor([len(i) for i, _ in enc])[:, None]).long()
        return ids, attn, labels


def logps(model, ids, attn, labels):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    tgt = labels[:, 1:]
    mask = tgt != -100
    lp = torch.gather(logits.log_softmax(-1), 2, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (lp * mask).sum(-1)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    ref_model.eval()
    for p in ref_model.parameters():
        p.requires_grad_(False)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    data = load_dataset("argilla/dpo-mix-7k")
    train_sampler = DistributedSampler(data["train"], shuffle=True, seed=42)
    collate = PairCollator(tok, args.max_len)
    train_dl = DataLoader(data["train"], batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=2, pin_memory=True)
    # eval shards are disjoint (no sampler padding) and are run on the unwrapped model
    test_shard = data["test"].shard(num_shards=world, index=rank, contiguous=True)
    test_dl = DataLoader(test_shard, batch_size=args.batch_size, collate_fn=collate)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(train_dl) / args.grad_accum)
    total_steps = steps_per_epoch * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.1 * total_steps), total_steps)

    def dpo_step(batch, net):
        ids, attn, labels = (t.to(device, non_blocking=True) for t in batch)
        n = ids.shape[0] // 2
        pol = logps(net, ids, attn, labels)
        with torch.no_grad():
            ref = logps(ref_model, ids, attn, labels)
        logits = args.beta * ((pol[:n] - pol[n:]) - (ref[:n] - ref[n:]))
        loss = (-F.logsigmoid(logits) * (1 - args.label_smoothing)
                - F.logsigmoid(-logits) * args.label_smoothing).mean()
        acc = (logits > 0).float().mean()
        return loss, acc, logits.detach().mean() / args.beta

    @torch.no_grad()
    def evaluate():
        model.eval()
        tot = torch.zeros(3, device=device)
        for batch in test_dl:
            n = batch[0].shape[0] // 2
            loss, acc, _ = dpo_step(batch, model.module)
            tot += torch.stack([loss * n, acc * n, torch.tensor(float(n), device=device)])
        dist.all_reduce(tot)
        model.train()
        return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()

    global_step = 0
    model.train()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, batch in enumerate(train_dl):
            sync = (i + 1) % args.grad_accum == 0
            if sync:
                loss, acc, margin = dpo_step(batch, model)
                (loss / args.grad_accum).backward()
            else:
                with model.no_sync():
                    loss, acc, margin = dpo_step(batch, model)
                    (loss / args.grad_accum).backward()
            if not sync:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % 10 == 0:
                m = torch.stack([loss.detach(), acc, margin])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {global_step}/{total_steps} loss {m[0]:.4f} acc {m[1]:.3f} "
                          f"margin {m[2]:.3f} lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)

            if global_step % args.save_steps == 0:
                ckpt = os.path.join(args.output_dir, f"checkpoint-{global_step}")
                os.makedirs(ckpt, exist_ok=True)
                model.module.save_pretrained(ckpt, safe_serialization=True)
                tok.save_pretrained(ckpt)
                torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": global_step},
                           os.path.join(ckpt, "trainer_state.pt"))
                old = sorted(glob.glob(os.path.join(args.output_dir, "checkpoint-*")),
                             key=lambda p: int(p.rsplit("-", 1)[1]))[:-args.keep_last]
                for p in old:
                    shutil.rmtree(p, ignore_errors=True)

        ev_loss, ev_acc = evaluate()
        if rank == 0:
            print(f"epoch {epoch} eval loss {ev_loss:.4f} reward acc {ev_acc:.3f}", flush=True)

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"), safe_serialization=True)
        tok.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
