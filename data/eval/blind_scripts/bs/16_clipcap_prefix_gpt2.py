"""ClipCap: CLIP image embedding -> MLP prefix -> GPT-2 captioner (COCO).

CLIP image embeddings are extracted once and cached next to the annotation file,
training then runs on the cached embeddings only.

    torchrun --nproc_per_node=4 16_clipcap_prefix_gpt2.py --ann /data/coco/annotations/captions_train2017.json \
        --images /data/coco/train2017 --val-ann /data/coco/annotations/captions_val2017.json \
        --val-images /data/coco/val2017 --out runs/clipcap
"""
import argparse
import json
import os

import clip
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from pycocoevalcap.cider.cider import Cider
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import GPT2LMHeadModel, GPT2Tokenizer


@torch.no_grad()
def extract_clip_features(ann_file, image_dir, cache_path, device, clip_name="ViT-B/32"):
    if os.path.exists(cache_path):
        return torch.load(cache_path)
    model, preprocess = clip.load(clip_name, device=device, jit=False)
    anns = json.load(open(ann_file))
    images = {im["id"]: im["file_name"] for im in anns["images"]}
    ids = sorted(images)
    feats = []
    for start in tqdm(range(0, len(ids), 256), desc="clip features"):
        batch = torch.stack([preprocess(Image.open(os.path.join(image_dir, images[i])).convert("RGB"))
                             for i in ids[start:start + 256]]).to(device)
        feats.append(model.encode_image(batch).float().cpu())
    captions = {}
    for a in anns["annotations"]:
        captions.setdefault(a["image_id"], []).append(a["caption"].strip())
    data = {"image_ids": ids, "features": torch.cat(feats), "captions": captions}
    torch.save(data, cache_path)
    del model
    torch.cuda.empty_cache()
    return data


class CachedCaptions(Dataset):
    def __init__(self, data, tokenizer, max_len=40):
        row = {iid: k for k, iid in enumerate(data["image_ids"])}
        self.feats = data["features"]
        self.samples = [(row[iid], c) for iid, caps in data["captions"].items() for c in caps]
        self.tok, self.max_len = tokenizer, max_len

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        r, cap = self.samples[i]
        ids = self.tok.encode(cap + self.tok.eos_token)[:self.max_len]
        return self.feats[r], torch.tensor(ids)


def pad_batch(batch):
    feats, ids = zip(*batch)
    L = max(len(x) for x in ids)
    tokens = torch.zeros(len(ids), L, dtype=torch.long)
    mask = torch.zeros(len(ids), L, dtype=torch.long)
    for i, x in enumerate(ids):
        tokens[i, :len(x)] = x
        mask[i, :len(x)] = 1
    return torch.stack(feats), tokens, mask


class ClipCaptionModel(nn.Module):
    def __init__(self, prefix_len=10, clip_dim=512):
        super().__init__()
        self.prefix_len = prefix_len
        self.gpt = GPT2LMHeadModel.from_pretrained("gpt2")
        d = self.gpt.config.n_embd
        self.project = nn.Sequential(nn.Linear(clip_dim, d * prefix_len // 2), nn.Tanh(),
                                     nn.Linear(d * prefix_len // 2, d * prefix_len))

    def prefix(self, clip_feats):
        return self.project(clip_feats).view(clip_feats.size(0), self.prefix_len, -1)

    def forward(self, clip_feats, tokens, mask):
        emb = self.gpt.transformer.wte(tokens)
        x = torch.cat([self.prefix(clip_feats), emb], 1)
        m = torch.cat([torch.ones(tokens.size(0), self.prefix_len, device=mask.device, dtype=mask.dtype), mask], 1)
        logits = self.gpt(inputs_embeds=x, attention_mask=m).logits[:, self.prefix_len - 1:-1]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens.flatten(), ignore_index=0,
                               reduction="none").view_as(tokens).mul(mask).sum() / mask.sum()

    @torch.no_grad()
    def greedy(self, clip_feats, tok, max_len=30):
        x = self.prefix(clip_feats)
        out = torch.zeros(clip_feats.size(0), 0, dtype=torch.long, device=clip_feats.device)
        past = None
        for _ in range(max_len):
            o = self.gpt(inputs_embeds=x, past_key_values=past, use_cache=True)
            past = o.past_key_values
            nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], 1)
            x = self.gpt.transformer.wte(nxt)
        return [tok.decode(s).split(tok.eos_token)[0].strip() for s in out.tolist()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ann", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--val-ann", required=True)
    ap.add_argument("--val-images", required=True)
    ap.add_argument("--out", default="runs/clipcap")
    ap.add_argument("--bs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_data = extract_clip_features(args.ann, args.images, args.ann.replace(".json", "_clipB32.pt"), device)
    val_data = extract_clip_features(args.val_ann, args.val_images, args.val_ann.replace(".json", "_clipB32.pt"), device)

    tok = GPT2Tokenizer.from_pretrained("gpt2")
    train_ds = CachedCaptions(train_data, tok)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=2, collate_fn=pad_batch,
                        drop_last=True, pin_memory=True)

    model = ClipCaptionModel().to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5000) * max(0.0, 1 - s / total))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    # val images split across ranks by position
    val_rows = list(range(rank, len(val_data["image_ids"]), world))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (feats, tokens, mask) in enumerate(loader):
            feats, tokens, mask = feats.to(device), tokens.to(device), mask.to(device)
            loss = model(feats, tokens, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if step % 500 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{len(loader)} loss {l.item():.4f}", flush=True)

        model.eval()
        preds = {}
        for s in range(0, len(val_rows), 256):
            rows = val_rows[s:s + 256]
            caps = model.module.greedy(val_data["features"][rows].to(device), tok)
            for r, c in zip(rows, caps):
                preds[val_data["image_ids"][r]] = [c]
        parts = [None] * world
        dist.all_gather_object(parts, preds)
        if rank == 0:
            preds = {k: v for p in parts for k, v in p.items()}
            refs = {k: val_data["captions"][k] for k in preds}
            cider, _ = Cider().compute_score(refs, preds)
            print(f"epoch {epoch}: val CIDEr (greedy) {cider:.4f} on {len(preds)} images")
            torch.save(model.module.state_dict(), os.path.join(args.out, f"clipcap_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
