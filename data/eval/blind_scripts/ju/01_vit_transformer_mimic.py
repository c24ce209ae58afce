#!/usr/bin/env python
"""ViT encoder + Transformer decoder for MIMIC-CXR findings generation.

Validation reports token-level loss, BLEU-4 and CheXbert (14-label and 5-label)
micro F1 each epoch; the best checkpoint is kept by 5-label micro F1.
"""
import argparse
import logging
import math
import os
import time

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from f1chexbert import F1CheXbert
from PIL import Image
from pycocoevalcap.bleu.bleu import Bleu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger("r2g")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="data/mimic_cxr/findings_split.csv")
    p.add_argument("--image-root", default="data/mimic_cxr/files_512")
    p.add_argument("--tokenizer", default="emilyalsentzer/Bio_ClinicalBERT")
    p.add_argument("--encoder", default="vit_base_patch16_224.augreg_in21k")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--enc-lr", type=float, default=2e-5)
    p.add_argument("--warmup-steps", type=int, default=1000)
    p.add_argument("--beam-size", type=int, default=3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="runs/vit_tfm")
    return p.parse_args()


class CXRReportDataset(Dataset):
    def __init__(self, df, image_root, tokenizer, max_len, train):
        self.df = df.reset_index(drop=True)
        self.image_root = image_root
        self.tok = tokenizer
        self.max_len = max_len
        norm = transforms.Normalize([0.5] * 3, [0.5] * 3)
        if train:
            self.tf = transforms.Compose([
                transforms.RandomResizedCrop(224, scale=(0.7, 1.0)),
                transforms.RandomRotation(5),
                transforms.ToTensor(), norm])
        else:
            self.tf = transforms.Compose([
                transforms.Resize(256), transforms.CenterCrop(224),
                transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        img = Image.open(os.path.join(self.image_root, row.image_path)).convert("RGB")
        enc = self.tok(row.findings, max_length=self.max_len, truncation=True,
                       padding="max_length", return_tensors="pt")
        return {"image": self.tf(img), "input_ids": enc.input_ids[0],
                "attention_mask": enc.attention_mask[0], "report": row.findings}


class ReportGenerator(nn.Module):
    def __init__(self, encoder_name, vocab_size, d_model, n_layers, max_len, pad_id):
        super().__init__()
        self.encoder = timm.create_model(encoder_name, pretrained=True, num_classes=0)
        self.proj = nn.Linear(self.encoder.num_features, d_model)
        self.tok_emb = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.pos_emb = nn.Parameter(torch.zeros(1, max_len, d_model))
        layer = nn.TransformerDecoderLayer(d_model, 8, 4 * d_model, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, n_layers)
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        nn.init.trunc_normal_(self.pos_emb, std=0.02)

    def encode(self, images):
        return self.proj(self.encoder.forward_features(images))

    def decode(self, tokens, memory):
        T = tokens.size(1)
        x = self.tok_emb(tokens) + self.pos_emb[:, :T]
        mask = torch.triu(torch.full((T, T), float("-inf"), device=tokens.device), 1)
        return self.lm_head(self.norm(self.decoder(x, memory, tgt_mask=mask)))

    def forward(self, images, tokens):
        return self.decode(tokens, self.encode(images))

    @torch.no_grad()
    def beam_search(self, images, bos_id, eos_id, beam_size=3, max_len=128):
        memory = self.encode(images)
        B, dev = memory.size(0), images.device
        memory = memory.repeat_interleave(beam_size, dim=0)
        seqs = torch.full((B * beam_size, 1), bos_id, dtype=torch.long, device=dev)
        scores = torch.zeros(B, beam_size, device=dev)
        scores[:, 1:] = -1e9
        scores = scores.view(-1)
        done = torch.zeros(B * beam_size, dtype=torch.bool, device=dev)
        base = (torch.arange(B, device=dev) * beam_size).unsqueeze(1)
        for _ in range(max_len - 1):
            logp = F.log_softmax(self.decode(seqs, memory)[:, -1].float(), dim=-1)
            logp[done] = -1e9
            logp[done, eos_id] = 0.0
            V = logp.size(-1)
            top, idx = (scores.unsqueeze(1) + logp).view(B, -1).topk(beam_size, dim=-1)
            sel = (base + idx // V).view(-1)
            nxt = (idx % V).view(-1, 1)
            seqs = torch.cat([seqs[sel], nxt], dim=1)
            done = done[sel] | (nxt.squeeze(1) == eos_id)
            scores = top.view(-1)
            if done.all():
                break
        best = scores.view(B, beam_size).argmax(-1)
        return seqs.view(B, beam_size, -1)[torch.arange(B, device=dev), best]


@torch.no_grad()
def evaluate(model, loader, tok, chexbert, args, device):
    model.eval()
    net = model.module
    loss_sum = torch.zeros(2, device=device)
    hyps, refs = [], []
    for batch in loader:
        images = batch["image"].to(device, non_blocking=True)
        ids = batch["input_ids"].to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(images, ids[:, :-1])
        tgt = ids[:, 1:]
        loss_sum[0] += F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                       tgt.reshape(-1), ignore_index=tok.pad_token_id,
                                       reduction="sum")
        loss_sum[1] += (tgt != tok.pad_token_id).sum()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net.beam_search(images, tok.cls_token_id, tok.sep_token_id,
                                  args.beam_size, args.max_len)
        hyps.extend(tok.batch_decode(out, skip_special_tokens=True))
        refs.extend(batch["report"])
    dist.all_reduce(loss_sum)
    _, _, report14, report5 = chexbert(hyps=hyps, refs=refs)
    bleu, _ = Bleu(4).compute_score({i: [r] for i, r in enumerate(refs)},
                                    {i: [h] for i, h in enumerate(hyps)}, verbose=0)
    model.train()
    return {"val_loss": (loss_sum[0] / loss_sum[1]).item(),
            "bleu4": bleu[3],
            "f1_14_micro": report14["micro avg"]["f1-score"],
            "f1_5_micro": report5["micro avg"]["f1-score"]}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(1234 + rank)

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    df = pd.read_csv(args.csv)
    df = df[df.findings.notna() & (df.findings.str.len() > 10)]
    train_ds = CXRReportDataset(df[df.split == "train"], args.image_root, tok, args.max_len, True)
    val_ds = CXRReportDataset(df[df.split == "validate"], args.image_root, tok, args.max_len, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = ReportGenerator(args.encoder, tok.vocab_size, args.d_model, args.layers,
                            args.max_len, tok.pad_token_id).to(device)
    model = DDP(model, device_ids=[local_rank])
    enc_params = list(model.module.encoder.parameters())
    enc_ids = {id(p) for p in enc_params}
    other = [p for p in model.parameters() if id(p) not in enc_ids]
    opt = torch.optim.AdamW([{"params": enc_params, "lr": args.enc_lr},
                             {"params": other, "lr": args.lr}], weight_decay=0.01)
    total = args.epochs * len(train_loader)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup_steps, total)
    chexbert = F1CheXbert(device=device)

    os.makedirs(args.out, exist_ok=True)
    best = -1.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for batch in train_loader:
            images = batch["image"].to(device, non_blocking=True)
            ids = batch["input_ids"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(images, ids[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                       ids[:, 1:].reshape(-1), ignore_index=tok.pad_token_id,
                                       label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0 and rank == 0:
                logger.info("ep %d step %d loss %.4f lr %.2e", epoch, step, loss.item(),
                            sched.get_last_lr()[1])

        metrics = evaluate(model, val_loader, tok, chexbert, args, device)
        if rank == 0:
            logger.info("epoch %d (%.0fs) %s", epoch, time.time() - t0,
                        " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch, "metrics": metrics}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if metrics["f1_5_micro"] > best:
                best = metrics["f1_5_micro"]
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        logger.info("best 5-label micro F1 %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
