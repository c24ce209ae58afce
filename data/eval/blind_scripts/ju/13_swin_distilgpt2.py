"""Swin-T + DistilGPT2 (cross-attention) report generation, tracked in Weights & Biases.

    torchrun --nproc_per_node=8 13_swin_distilgpt2.py --wandb-project cxr-rrg --run-name swin_dgpt2
"""
import argparse
import os
import time

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from f1chexbert import F1CheXbert
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import GPT2LMHeadModel, GPT2TokenizerFast, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="data/mimic_cxr_findings.csv")
    ap.add_argument("--img-dir", default="data/mimic_cxr_224")
    ap.add_argument("--ckpt-dir", default="/shared/ckpt/swin_dgpt2")
    ap.add_argument("--wandb-project", default="cxr-rrg")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-len", type=int, default=100)
    ap.add_argument("--val-every", type=int, default=2)
    return ap.parse_args()


class FindingsSet(Dataset):
    def __init__(self, df, img_dir, tok, max_len, train):
        self.df = df.reset_index(drop=True)
        self.img_dir, self.tok, self.max_len = img_dir, tok, max_len
        self.tf = transforms.Compose(
            ([transforms.RandomAffine(5, translate=(0.03, 0.03))] if train else [])
            + [transforms.Resize((224, 224)), transforms.ToTensor(),
               transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        img = self.tf(Image.open(os.path.join(self.img_dir, row.image)).convert("RGB"))
        ids = self.tok.encode(row.findings)[: self.max_len - 2]
        ids = [self.tok.bos_token_id] + ids + [self.tok.eos_token_id]
        attn = [1] * len(ids) + [0] * (self.max_len - len(ids))
        ids = ids + [self.tok.eos_token_id] * (self.max_len - len(ids))
        return img, torch.tensor(ids), torch.tensor(attn), i


class SwinDistilGPT2(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = timm.create_model("swin_tiny_patch4_window7_224.ms_in22k_ft_in1k", pretrained=True,
                                     num_classes=0)
        self.dec = GPT2LMHeadModel.from_pretrained("distilgpt2", add_cross_attention=True)
        self.enc_ln = nn.LayerNorm(self.enc.num_features)

    def memory(self, x):
        return self.enc_ln(self.enc.forward_features(x).flatten(1, 2))

    def forward(self, x, ids, attn):
        return self.dec(input_ids=ids, attention_mask=attn, encoder_hidden_states=self.memory(x)).logits

    @torch.no_grad()
    def greedy(self, x, bos, eos, max_len):
        mem = self.memory(x)
        ids = torch.full((x.size(0), 1), bos, dtype=torch.long, device=x.device)
        past, cur = None, ids
        finished = torch.zeros(x.size(0), dtype=torch.bool, device=x.device)
        for _ in range(max_len - 1):
            out = self.dec(input_ids=cur, encoder_hidden_states=mem, past_key_values=past, use_cache=True)
            past = out.past_key_values
            cur = out.logits[:, -1].argmax(-1, keepdim=True)
            cur = cur.masked_fill(finished[:, None], eos)
            ids = torch.cat([ids, cur], 1)
            finished |= cur.squeeze(1) == eos
            if finished.all():
                break
        return ids


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    run = wandb.init(project=args.wandb_project, name=args.run_name, config={**vars(args), "world_size": world})

    tok = GPT2TokenizerFast.from_pretrained("distilgpt2")
    df = pd.read_csv(args.csv)
    train_ds = FindingsSet(df[df.split == "train"], args.img_dir, tok, args.max_len, True)
    val_ds = FindingsSet(df[df.split == "validate"], args.img_dir, tok, args.max_len, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=train_sampler, num_workers=8, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(val_ds, args.bs, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=8,
                        pin_memory=True)

    model = DDP(SwinDistilGPT2().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = get_cosine_schedule_with_warmup(opt, 1000, args.epochs * len(train_dl))
    chexbert = F1CheXbert(device=device) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, ids, attn, _ in train_dl:
            x, ids, attn = x.to(device, non_blocking=True), ids.to(device), attn.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, ids[:, :-1], attn[:, :-1])
            tgt = ids[:, 1:].masked_fill(attn[:, 1:] == 0, -100)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 20 == 0:
                wandb.log({"train/loss": loss.item(), "train/grad_norm": gn.item(),
                           "train/lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.val_every:
            continue
        model.eval()
        local = []
        for x, _, _, idx in val_dl:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                gen = model.module.greedy(x.to(device), tok.bos_token_id, tok.eos_token_id, args.max_len)
            local += zip(idx.tolist(), tok.batch_decode(gen[:, 1:], skip_special_tokens=True))
        parts = [None] * world
        dist.all_gather_object(parts, local)
        if rank == 0:
            preds = dict(p for part in parts for p in part)
            keys = sorted(preds)
            hyps = [preds[k] for k in keys]
            refs = [val_ds.df.findings[k] for k in keys]
            _, _, r14, r5 = chexbert(hyps=hyps, refs=refs)
            metrics = {"val/ce_micro_f1_14": r14["micro avg"]["f1-score"],
                       "val/ce_macro_f1_14": r14["macro avg"]["f1-score"],
                       "val/ce_micro_f1_5": r5["micro avg"]["f1-score"]}
            table = wandb.Table(columns=["reference", "generated"], data=list(zip(refs[:20], hyps[:20])))
            wandb.log({**metrics, "val/samples": table}, step=step)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(args.ckpt_dir, "last.pt"))
            if metrics["val/ce_micro_f1_14"] > best:
                best = metrics["val/ce_micro_f1_14"]
                torch.save(state, os.path.join(args.ckpt_dir, "best.pt"))
                run.summary["best_ce_micro_f1_14"] = best
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
