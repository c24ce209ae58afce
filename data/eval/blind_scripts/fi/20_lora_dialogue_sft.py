#!/usr/bin/env python
"""LoRA SFT on multi-turn dialogues (persona chat + in-house agent logs).

Writes a light training checkpoint (LoRA tensors + optimizer + scheduler) every
--ckpt_every updates so jobs can be requeued; the final adapter is saved with
save_pretrained for inference.

    torchrun --nproc_per_node=8 20_lora_dialogue_sft.py --model meta-llama/Llama-2-7b-chat-hf \
        --data data/dialogues --out runs/dialogue-lora [--resume runs/dialogue-lora/last.pt]
"""
import argparse
import contextlib
import json
import logging
import math
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup, set_seed
from peft import LoraConfig, get_peft_model

log = logging.getLogger("dialogue")
B_INST, E_INST = "[INST]", "[/INST]"


def encode_dialogue(turns, tok, max_len):
    """turns alternate user / assistant; loss only on assistant turns."""
    ids, labels = [tok.bos_token_id], [-100]
    for u, a in zip(turns[0::2], turns[1::2]):
        u_ids = tok(f"{B_INST} {u.strip()} {E_INST}", add_special_tokens=False)["input_ids"]
        a_ids = tok(f" {a.strip()} ", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids += u_ids + a_ids
        labels += [-100] * len(u_ids) + a_ids
    return ids[:max_len], labels[:max_len]


class DialogueDataset(Dataset):
    def __init__(self, path, tok, max_len):
        self.rows = [encode_dialogue(json.loads(l)["turns"], tok, max_len) for l in open(path)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(batch, pad_id=0):
    n = max(len(x) for x, _ in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    lab = torch.full((len(batch), n), -100, dtype=torch.long)
    att = torch.zeros((len(batch), n), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        lab[i, : len(y)] = torch.tensor(y)
        att[i, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": att, "labels": lab}


def save_training_checkpoint(model, optimizer, scheduler, epoch, update, path):
    lora_state = {k: v.detach().cpu() for k, v in model.state_dict().items() if "lora_" in k}
    tmp = path + ".tmp"
    torch.save({"lora": lora_state, "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": epoch, "update": update}, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    agg = torch.zeros(2, device=device)
    for b in loader:
        b = {k: v.to(device) for k, v in b.items()}
        loss = model(**b).loss
        n = (b["labels"][:, 1:] != -100).sum()
        agg[0] += loss.float() * n
        agg[1] += n
    dist.all_reduce(agg)
    model.train()
    return (agg[0] / agg[1].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-2-7b-chat-hf")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/dialogue-lora")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--ckpt_every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    os.makedirs(args.out, exist_ok=True)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    peft_model.to(device)

    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)

    train_ds = DialogueDataset(os.path.join(args.data, "train.jsonl"), tok, args.max_len)
    val_ds = DialogueDataset(os.path.join(args.data, "val.jsonl"), tok, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate,
                          num_workers=2, pin_memory=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.bs, collate_fn=collate)
    total = math.ceil(len(train_dl) / args.accum) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total), total)

    start_epoch, update = 0, 0
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        res = peft_model.load_state_dict(ckpt["lora"], strict=False)
        log.info("resumed LoRA weights (%d unexpected keys)", len(res.unexpected_keys))
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, update = ckpt["epoch"], ckpt["update"]

    model = DDP(peft_model, device_ids=[local_rank])
    last_ckpt = os.path.join(args.out, "last.pt")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync = (i + 1) % args.accum == 0 or (i + 1) == len(train_dl)
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = model(**batch).loss / args.accum
                loss.backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1
            if update % 20 == 0:
                log.info("epoch %d update %d/%d loss %.4f", epoch, update, total, loss.item() * args.accum)
            if update % args.ckpt_every == 0:
                if rank == 0:
                    save_training_checkpoint(model, optimizer, scheduler, epoch, update, last_ckpt)
                dist.barrier()

        val = evaluate(peft_model, val_dl, device)
        log.info("epoch %d val loss %.4f ppl %.2f", epoch, val, math.exp(val))

    if rank == 0:
        peft_model.save_pretrained(os.path.join(args.out, "adapter"))
        tok.save_pretrained(os.path.join(args.out, "adapter"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
