"""Prefix captioning: CLIP ViT-L/14 patch tokens -> query resampler -> OPT-350m.

fp16 mixed precision on V100 nodes; COCO Karpathy split, CIDEr on full val.

torchrun --nproc_per_node=8 20_clip_opt_prefix_caption.py --coco /data/coco --out /nfs/exp/opt_prefix
"""
import argparse
import json
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

import timm
from transformers import AutoTokenizer, OPTForCausalLM, get_cosine_schedule_with_warmup
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

log = logging.getLogger("opt_prefix")


class Coco(Dataset):
    def __init__(self, root, split, tf):
        ims = [im for im in json.load(open(f"{root}/dataset_coco.json"))["images"]
               if im["split"] in ({"train", "restval"} if split == "train" else {split})]
        self.root, self.tf, self.train = root, tf, split == "train"
        self.rows = [(im, s["raw"].strip()) for im in ims for s in im["sentences"]] if self.train else [(im, "") for im in ims]
        self.refs = {im["cocoid"]: [s["raw"] for s in im["sentences"]] for im in ims}

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        im, cap = self.rows[i]
        return self.tf(Image.open(f"{self.root}/{im['filepath']}/{im['filename']}").convert("RGB")), cap, im["cocoid"]


class Resampler(nn.Module):
    def __init__(self, d_in, d_out, n_query=32, layers=2):
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, n_query, d_in) * 0.02)
        self.layers = nn.ModuleList(nn.TransformerDecoderLayer(d_in, 16, 4 * d_in, 0.0, batch_first=True, norm_first=True)
                                    for _ in range(layers))
        self.out = nn.Sequential(nn.LayerNorm(d_in), nn.Linear(d_in, d_out))

    def forward(self, feats):
        q = self.query.expand(feats.size(0), -1, -1)
        for layer in self.layers:
            q = layer(q, feats)
        return self.out(q)


class PrefixCaptioner(nn.Module):
    def __init__(self, vit, lm):
        super().__init__()
        self.vit = timm.create_model(vit, pretrained=True, num_classes=0)
        self.lm = OPTForCausalLM.from_pretrained(lm)
        # OPT-350m projects 512-d word embeddings up to its 1024-d hidden size
        self.resampler = Resampler(self.vit.num_features, self.lm.config.word_embed_proj_dim)

    def prefix(self, images):
        return self.resampler(self.vit.forward_features(images))

    def forward(self, images, ids, attn):
        p = self.prefix(images)
        x = torch.cat([p, self.lm.get_input_embeddings()(ids)], 1)
        mask = torch.cat([torch.ones(p.shape[:2], dtype=attn.dtype, device=attn.device), attn], 1)
        labels = torch.cat([torch.full(p.shape[:2], -100, dtype=ids.dtype, device=ids.device),
                            ids.masked_fill(attn == 0, -100)], 1)
        labels[:, p.size(1)] = -100  # no loss on the </s> bos token OPT prepends
        return self.lm(inputs_embeds=x, attention_mask=mask, labels=labels).loss

    @torch.no_grad()
    def caption(self, images, bos_id, num_beams=3, max_new_tokens=30):
        p = self.prefix(images)
        bos = self.lm.get_input_embeddings()(torch.full((images.size(0), 1), bos_id, device=images.device))
        x = torch.cat([p, bos], 1)
        mask = torch.ones(x.shape[:2], dtype=torch.long, device=images.device)
        return self.lm.generate(inputs_embeds=x, attention_mask=mask, num_beams=num_beams,
                                max_new_tokens=max_new_tokens)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coco", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vit", default="vit_large_patch14_clip_224.openai")
    ap.add_argument("--lm", default="facebook/opt-350m")
    ap.add_argument("--global_batch", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--vit_lr", type=float, default=1e-5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s r{rank} %(levelname)s %(message)s")

    tok = AutoTokenizer.from_pretrained(args.lm)
    dcfg = timm.data.resolve_data_config({}, model=args.vit)
    norm = transforms.Normalize(dcfg["mean"], dcfg["std"])
    train_set = Coco(args.coco, "train", transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.7, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.ToTensor(), norm]))
    val_set = Coco(args.coco, "val", transforms.Compose([
        transforms.Resize(224, interpolation=transforms.InterpolationMode.BICUBIC), transforms.CenterCrop(224),
        transforms.ToTensor(), norm]))
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.global_batch // world, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64, sampler=DistributedSampler(val_set, shuffle=False), num_workers=8)

    model = PrefixCaptioner(args.vit, args.lm).to(device)
    model = DDP(model, device_ids=[local_rank])
    vit_params = [p for n, p in model.module.named_parameters() if n.startswith("vit.")]
    other = [p for n, p in model.module.named_parameters() if not n.startswith("vit.")]
    optimizer = torch.optim.AdamW([{"params": vit_params, "lr": args.vit_lr}, {"params": other, "lr": args.lr}],
                                  weight_decay=0.05)
    total = len(loader) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total), total)
    scaler = torch.cuda.amp.GradScaler(init_scale=2 ** 14)

    best, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for images, caps, _ in loader:
            enc = tok([c + tok.eos_token for c in caps], padding="longest", truncation=True, max_length=40,
                      return_tensors="pt").to(device)
            images = images.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(images, enc.input_ids, enc.attention_mask)
            if not torch.isfinite(loss):
                log.warning("non-finite loss at step %d, skipping batch", step)
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    log.info("epoch %d step %d/%d loss %.4f scale %.0f", epoch, step, total, l.item(), scaler.get_scale())

        model.eval()
        local = {}
        for images, _, ids in val_loader:
            with torch.autocast("cuda", dtype=torch.float16):
                out = model.module.caption(images.to(device), tok.bos_token_id)
            for i, c in zip(ids.tolist(), tok.batch_decode(out, skip_special_tokens=True)):
                local[i] = c.strip()
        parts = [None] * world
        dist.all_gather_object(parts, local)
        if rank == 0:
            preds = {k: v for p in parts for k, v in p.items()}
            ptb = PTBTokenizer()
            gts = ptb.tokenize({k: [{"caption": c} for c in val_set.refs[k]] for k in preds})
            res = ptb.tokenize({k: [{"caption": v}] for k, v in preds.items()})
            cider = Cider().compute_score(gts, res)[0]
            bleu4 = Bleu(4).compute_score(gts, res)[0][3]
            log.info("epoch %d CIDEr %.4f BLEU-4 %.4f over %d images", epoch, cider, bleu4, len(preds))
            os.makedirs(args.out, exist_ok=True)
            trainable = model.module.state_dict()
            torch.save({"model": trainable, "epoch": epoch, "step": step}, os.path.join(args.out, "last.pt"))
            if cider > best:
                best = cider
                torch.save({"model": trainable, "epoch": epoch}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
