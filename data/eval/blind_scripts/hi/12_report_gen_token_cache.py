"""
MIMIC-CXR report generation (findings + impression) with a Swin-B visual encoder and a
6-layer Transformer decoder. Reports are cleaned and tokenized once and cached as a .pt file
next to the split csv, because cleaning 220k reports with the section parser takes ~15 min.

    torchrun --nproc_per_node=8 12_report_gen_token_cache.py --data-dir /data/mimic_rrg --cache-dir /data/mimic_rrg/cache
"""
import argparse
import os
import re
import time

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from tqdm import tqdm
from transformers import AutoTokenizer

SECTION_RE = re.compile(r"(FINDINGS|IMPRESSION)\s*:", re.I)


def clean_report(text):
    """Keep FINDINGS and IMPRESSION, drop comparison / wet read / dictation noise."""
    parts = SECTION_RE.split(text)
    keep = []
    for i in range(1, len(parts) - 1, 2):
        keep.append(parts[i + 1])
    body = " ".join(keep) if keep else text
    body = re.sub(r"_+", " ", body)
    body = re.sub(r"\s+", " ", body)
    return body.strip().lower()


class ReportGenDataset(Dataset):
    def __init__(self, data_dir, split, tokenizer, cache_dir, max_len=128, image_size=384, train=True):
        self.data_dir = data_dir
        cache_file = os.path.join(cache_dir, f"{split}_{tokenizer.name_or_path.replace('/', '_')}_{max_len}.pt")
        if os.path.exists(cache_file):
            cached = torch.load(cache_file)
        else:
            df = pd.read_csv(os.path.join(data_dir, f"{split}.csv"))
            ids, paths = [], []
            for row in tqdm(df.itertuples(), total=len(df), desc=f"tokenize {split}"):
                with open(os.path.join(data_dir, "reports", row.report_path)) as f:
                    text = clean_report(f.read())
                if len(text) < 10:
                    continue
                ids.append(tokenizer(text, max_length=max_len, truncation=True, padding="max_length",
                                     return_tensors="pt").input_ids[0])
                paths.append(row.image_path)
            cached = {"input_ids": torch.stack(ids), "image_paths": paths}
            os.makedirs(cache_dir, exist_ok=True)
            torch.save(cached, cache_file)
        self.input_ids = cached["input_ids"]
        self.image_paths = cached["image_paths"]
        norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        if train:
            self.tf = T.Compose([T.RandomResizedCrop(image_size, scale=(0.8, 1.0)), T.ToTensor(), norm])
        else:
            self.tf = T.Compose([T.Resize((image_size, image_size)), T.ToTensor(), norm])

    def __len__(self):
        return len(self.image_paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.data_dir, "images", self.image_paths[i])).convert("RGB")
        return self.tf(img), self.input_ids[i]


class CXRReportModel(nn.Module):
    def __init__(self, vocab_size, pad_id, d_model=768, n_layers=6, max_len=128):
        super().__init__()
        self.backbone = timm.create_model("swin_base_patch4_window12_384.ms_in22k_ft_in1k", pretrained=True,
                                          num_classes=0, global_pool="")
        self.img_proj = nn.Linear(self.backbone.num_features, d_model)
        self.tok_emb = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.pos_emb = nn.Parameter(torch.zeros(1, max_len, d_model))
        nn.init.trunc_normal_(self.pos_emb, std=0.02)
        layer = nn.TransformerDecoderLayer(d_model, 12, 4 * d_model, dropout=0.1, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, n_layers)
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size, bias=False)
        self.out.weight = self.tok_emb.weight
        self.pad_id = pad_id

    def forward(self, images, tokens):
        mem = self.backbone.forward_features(images)           # B x H x W x C
        mem = self.img_proj(mem.flatten(1, 2))
        L = tokens.size(1)
        x = self.tok_emb(tokens) + self.pos_emb[:, :L]
        causal = nn.Transformer.generate_square_subsequent_mask(L, device=tokens.device)
        h = self.decoder(x, mem, tgt_mask=causal, tgt_key_padding_mask=tokens.eq(self.pad_id))
        return self.out(self.ln(h))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--tokenizer", default="microsoft/BiomedVLP-CXR-BERT-general")
    ap.add_argument("--out", default="checkpoints/rrg_swin")
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--max-len", type=int, default=128)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=True)
    train_ds = ReportGenDataset(args.data_dir, "train", tok, args.cache_dir, args.max_len, train=True)
    val_ds = ReportGenDataset(args.data_dir, "validate", tok, args.cache_dir, args.max_len, train=False)

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=8, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, sampler=val_sampler, num_workers=8, pin_memory=True)

    model = CXRReportModel(len(tok), tok.pad_token_id, max_len=args.max_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.05)
    total = args.epochs * len(train_dl)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total, pct_start=0.03,
                                                    anneal_strategy="cos")
    criterion = nn.CrossEntropyLoss(ignore_index=tok.pad_token_id, label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (img, ids) in enumerate(train_dl):
            img, ids = img.to(device, non_blocking=True), ids.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img, ids[:, :-1])
            loss = criterion(logits.float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for img, ids in val_dl:
                img, ids = img.to(device), ids.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(img, ids[:, :-1])
                tgt = ids[:, 1:]
                nll = nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tgt.reshape(-1),
                                                  ignore_index=tok.pad_token_id, reduction="sum")
                acc[0] += nll
                acc[1] += tgt.ne(tok.pad_token_id).sum()
        dist.all_reduce(acc)
        val_nll = (acc[0] / acc[1]).item()
        if rank == 0:
            print(f"epoch {epoch} val token NLL {val_nll:.4f}", flush=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "val_nll": val_nll}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val_nll < best:
                best = val_nll
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
