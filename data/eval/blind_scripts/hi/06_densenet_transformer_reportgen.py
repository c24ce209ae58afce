"""
Chest X-ray report generation: DenseNet-121 visual features -> 3-layer Transformer decoder.
IU X-Ray (Open-I) frontal images, findings + impression as target text.

    torchrun --nproc_per_node=4 06_densenet_transformer_reportgen.py --ann data/iu_xray/annotation.json \
        --images data/iu_xray/images --save-dir results/iu_densenet_tf
"""
import argparse
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from nltk.translate.bleu_score import corpus_bleu
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms
from transformers import AutoTokenizer


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ann", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--save-dir", default="results/iu_densenet_tf")
    ap.add_argument("--tokenizer", default="emilyalsentzer/Bio_ClinicalBERT")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=60)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr-ve", type=float, default=5e-5)
    ap.add_argument("--lr-ed", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=9223)
    return ap.parse_args()


class IUXray(Dataset):
    def __init__(self, ann, image_dir, split, tokenizer, max_len):
        self.items = ann[split]
        self.image_dir = image_dir
        self.tok = tokenizer
        self.max_len = max_len
        norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        if split == "train":
            self.tf = transforms.Compose([transforms.Resize(256), transforms.RandomCrop(224),
                                          transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
        else:
            self.tf = transforms.Compose([transforms.Resize((224, 224)), transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        img = Image.open(os.path.join(self.image_dir, it["image_path"][0])).convert("RGB")
        enc = self.tok(it["report"].lower(), max_length=self.max_len, truncation=True,
                       padding="max_length", return_tensors="pt")
        return self.tf(img), enc.input_ids[0], enc.attention_mask[0], i


class ReportGenerator(nn.Module):
    def __init__(self, vocab_size, pad_id, bos_id, eos_id, d_model=512, layers=3, max_len=60):
        super().__init__()
        dn = models.densenet121(weights=models.DenseNet121_Weights.IMAGENET1K_V1)
        self.visual = dn.features                      # B x 1024 x 7 x 7
        self.vis_proj = nn.Linear(1024, d_model)
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerDecoderLayer(d_model, nhead=8, dim_feedforward=2048, dropout=0.1, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers=layers)
        self.lm_head = nn.Linear(d_model, vocab_size)
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.max_len = max_len

    def encode(self, images):
        f = torch.relu(self.visual(images))
        f = f.flatten(2).transpose(1, 2)               # B x 49 x 1024
        return self.vis_proj(f)

    def decode(self, memory, tokens):
        T = tokens.size(1)
        pos = torch.arange(T, device=tokens.device)
        x = self.embed(tokens) + self.pos(pos)[None]
        causal = torch.triu(torch.full((T, T), float("-inf"), device=tokens.device), diagonal=1)
        h = self.decoder(x, memory, tgt_mask=causal, tgt_key_padding_mask=tokens.eq(self.pad_id))
        return self.lm_head(h)

    def forward(self, images, tokens):
        memory = self.encode(images)
        return self.decode(memory, tokens[:, :-1])

    @torch.no_grad()
    def generate(self, images, max_len=None):
        max_len = max_len or self.max_len
        memory = self.encode(images)
        seq = torch.full((images.size(0), 1), self.bos_id, dtype=torch.long, device=images.device)
        done = torch.zeros(images.size(0), dtype=torch.bool, device=images.device)
        for _ in range(max_len - 1):
            nxt = self.decode(memory, seq)[:, -1].argmax(-1)
            nxt = nxt.masked_fill(done, self.pad_id)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            done |= nxt.eq(self.eos_id)
            if done.all():
                break
        return seq


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    with open(args.ann) as f:
        ann = json.load(f)
    train_ds = IUXray(ann, args.images, "train", tok, args.max_len)
    val_ds = IUXray(ann, args.images, "val", tok, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, sampler=val_sampler, num_workers=4)

    net = ReportGenerator(tok.vocab_size, tok.pad_token_id, tok.cls_token_id, tok.sep_token_id,
                          args.d_model, args.layers, args.max_len)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])

    ve = list(model.module.visual.parameters())
    ve_ids = set(map(id, ve))
    ed = [p for p in model.parameters() if id(p) not in ve_ids]
    optim = torch.optim.Adam([{"params": ve, "lr": args.lr_ve}, {"params": ed, "lr": args.lr_ed}],
                             weight_decay=5e-5, amsgrad=True)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=50, gamma=0.1)
    ce = nn.CrossEntropyLoss(ignore_index=tok.pad_token_id)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best_bleu4 = 0.0

    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        total, n = 0.0, 0
        for images, ids, _, _ in train_dl:
            images, ids = images.to(device, non_blocking=True), ids.to(device, non_blocking=True)
            logits = model(images, ids)
            loss = ce(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
            optim.zero_grad()
            loss.backward()
            nn.utils.clip_grad_value_(model.parameters(), 0.1)
            optim.step()
            total += loss.item()
            n += 1
        sched.step()

        # greedy decoding on this rank's share of the validation split
        model.eval()
        local = []
        for images, ids, _, idx in val_dl:
            out = model.generate(images.to(device), max_len=args.max_len)
            hyps = tok.batch_decode(out, skip_special_tokens=True)
            refs = tok.batch_decode(ids, skip_special_tokens=True)
            local.extend(zip(idx.tolist(), hyps, refs))
        gathered = [None] * world
        dist.all_gather_object(gathered, local)

        if rank == 0:
            uniq = {}
            for part in gathered:
                for i, h, r in part:
                    uniq[i] = (h, r)
            hyps = [uniq[i][0].split() for i in sorted(uniq)]
            refs = [[uniq[i][1].split()] for i in sorted(uniq)]
            bleu4 = corpus_bleu(refs, hyps)
            print(f"epoch {epoch:3d} train loss {total / max(n, 1):.4f} val BLEU-4 {bleu4:.4f}", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optim": optim.state_dict()},
                       os.path.join(args.save_dir, "current_checkpoint.pth"))
            if bleu4 > best_bleu4:
                best_bleu4 = bleu4
                torch.save({"epoch": epoch, "model": model.module.state_dict()},
                           os.path.join(args.save_dir, "model_best.pth"))
                with open(os.path.join(args.save_dir, "best_samples.json"), "w") as f:
                    json.dump([{"id": i, "gen": uniq[i][0], "gt": uniq[i][1]} for i in sorted(uniq)[:50]],
                              f, indent=1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
