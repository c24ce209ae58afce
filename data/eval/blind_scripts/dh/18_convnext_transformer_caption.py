"""ConvNeXt-B grid features + 6-layer Transformer decoder captioner.

Trains with teacher forcing (cross-entropy, label smoothing) on COCO Karpathy
train+restval and evaluates CIDEr/BLEU on the full 5k val split.

torchrun --nproc_per_node=4 18_convnext_transformer_caption.py -c configs/convnext_b.yaml
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

import timm
from transformers import AutoTokenizer
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

DEFAULT_CFG = dict(
    karpathy="/data/coco/dataset_coco.json", images="/data/coco", out="exp/convnext_tr",
    backbone="convnext_base.fb_in22k_ft_in1k", tokenizer="facebook/bart-base",
    d_model=512, layers=6, heads=8, max_len=30,
    batch_size=50, epochs=15, lr=2e-4, backbone_lr=2e-5, warmup=4000, label_smoothing=0.1,
)


class KarpathyCaptions(Dataset):
    def __init__(self, cfg, split, tf):
        ims = [im for im in json.load(open(cfg["karpathy"]))["images"]
               if im["split"] in ({"train", "restval"} if split == "train" else {split})]
        self.train, self.tf, self.root = split == "train", tf, cfg["images"]
        self.entries = ([(im, s["raw"].strip()) for im in ims for s in im["sentences"]] if self.train
                        else [(im, None) for im in ims])
        self.refs = {im["cocoid"]: [s["raw"] for s in im["sentences"]] for im in ims}

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, i):
        im, cap = self.entries[i]
        img = self.tf(Image.open(os.path.join(self.root, im["filepath"], im["filename"])).convert("RGB"))
        return img, cap or "", im["cocoid"]


class CaptionTransformer(nn.Module):
    def __init__(self, cfg, vocab_size, pad_id):
        super().__init__()
        d = cfg["d_model"]
        self.backbone = timm.create_model(cfg["backbone"], pretrained=True, num_classes=0, global_pool="")
        self.feat_proj = nn.Sequential(nn.Linear(self.backbone.num_features, d), nn.LayerNorm(d))
        self.feat_pos = nn.Parameter(torch.zeros(1, 49, d))
        self.embed = nn.Embedding(vocab_size, d, padding_idx=pad_id)
        self.pos = nn.Embedding(cfg["max_len"], d)
        layer = nn.TransformerDecoderLayer(d, cfg["heads"], 4 * d, 0.1, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, cfg["layers"], norm=nn.LayerNorm(d))
        self.out = nn.Linear(d, vocab_size)
        nn.init.trunc_normal_(self.feat_pos, std=0.02)

    def memory(self, images):
        f = self.backbone.forward_features(images)      # B, C, 7, 7
        f = self.backbone.head.norm(f)                   # ConvNeXt keeps its final norm in the head
        f = f.flatten(2).transpose(1, 2)
        return self.feat_proj(f) + self.feat_pos

    def decode(self, mem, ids, pad_mask=None):
        T = ids.size(1)
        x = self.embed(ids) + self.pos(torch.arange(T, device=ids.device))
        causal = nn.Transformer.generate_square_subsequent_mask(T, device=ids.device)
        return self.out(self.decoder(x, mem, tgt_mask=causal, tgt_is_causal=True, tgt_key_padding_mask=pad_mask))

    def forward(self, images, ids, pad_mask):
        return self.decode(self.memory(images), ids, pad_mask)

    @torch.no_grad()
    def greedy(self, images, bos, eos, max_len):
        mem = self.memory(images)
        ids = torch.full((images.size(0), 1), bos, dtype=torch.long, device=images.device)
        for _ in range(max_len - 1):
            nxt = self.decode(mem, ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            if (ids == eos).any(1).all():
                break
        return ids


def evaluate(model, loader, tok, refs, cfg, device):
    model.eval()
    local = {}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        for images, _, ids in loader:
            out = model.module.greedy(images.to(device, non_blocking=True), tok.bos_token_id, tok.eos_token_id,
                                      cfg["max_len"])
            for i, text in zip(ids.tolist(), tok.batch_decode(out, skip_special_tokens=True)):
                local[i] = text.strip()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    model.train()
    if dist.get_rank() != 0:
        return None
    preds = {k: v for p in parts for k, v in p.items()}
    ptb = PTBTokenizer()
    gts = ptb.tokenize({k: [{"caption": c} for c in refs[k]] for k in preds})
    res = ptb.tokenize({k: [{"caption": v}] for k, v in preds.items()})
    bleu, _ = Bleu(4).compute_score(gts, res)
    return {"BLEU-1": bleu[0], "BLEU-4": bleu[3], "CIDEr": Cider().compute_score(gts, res)[0], "n": len(preds)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if a.config:
        cfg.update(yaml.safe_load(open(a.config)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(cfg["tokenizer"])
    tcfg = timm.data.resolve_data_config({}, model=cfg["backbone"])
    norm = transforms.Normalize(tcfg["mean"], tcfg["std"])
    train_set = KarpathyCaptions(cfg, "train", transforms.Compose([
        transforms.Resize(256), transforms.RandomCrop(224), transforms.ToTensor(), norm]))
    val_set = KarpathyCaptions(cfg, "val", transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))

    def collate(batch):
        imgs, caps, ids = zip(*batch)
        enc = tok(list(caps), padding="longest", truncation=True, max_length=cfg["max_len"], return_tensors="pt")
        return torch.stack(imgs), enc.input_ids, torch.tensor(ids)

    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], shuffle=True, num_workers=8,
                              collate_fn=collate, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=100, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=8, collate_fn=collate, pin_memory=True)

    model = CaptionTransformer(cfg, len(tok), tok.pad_token_id).to(device)
    model = DDP(model, device_ids=[local_rank])
    bb = [p for n, p in model.module.named_parameters() if n.startswith("backbone.")]
    rest = [p for n, p in model.module.named_parameters() if not n.startswith("backbone.")]
    optimizer = torch.optim.AdamW([{"params": bb, "lr": cfg["backbone_lr"]}, {"params": rest, "lr": cfg["lr"]}],
                                  weight_decay=0.05)
    total = cfg["epochs"] * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / cfg["warmup"],
                                              0.5 * (1 + math.cos(math.pi * s / total))))
    scaler = torch.cuda.amp.GradScaler()

    os.makedirs(cfg["out"], exist_ok=True)
    best, step = 0.0, 0
    for epoch in range(cfg["epochs"]):
        t0 = time.time()
        for images, ids, _ in train_loader:
            images, ids = images.to(device, non_blocking=True), ids.to(device, non_blocking=True)
            inp, tgt = ids[:, :-1], ids[:, 1:]
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(images, inp, inp == tok.pad_token_id)
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tgt.reshape(-1),
                                       ignore_index=tok.pad_token_id, label_smoothing=cfg["label_smoothing"])
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            step += 1
            if step % 200 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        scores = evaluate(model, val_loader, tok, val_set.refs, cfg, device)
        if rank == 0:
            print(f"epoch {epoch} val {json.dumps(scores)}", flush=True)
            torch.save({"model": model.module.state_dict(), "cfg": cfg, "epoch": epoch},
                       os.path.join(cfg["out"], "last.pth"))
            if scores["CIDEr"] > best:
                best = scores["CIDEr"]
                torch.save({"model": model.module.state_dict(), "cfg": cfg}, os.path.join(cfg["out"], "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
