"""Captioning (LM loss) with an image-text contrastive regulariser applied every
`--itc_every` steps, BLIP-style ViT-B/16 + BERT decoder. COCO Karpathy split.

torchrun --nproc_per_node=8 17_blip_cap_itc_regularized.py --data /data/coco --resume auto
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

import timm
from transformers import BertConfig, BertLMHeadModel, BertModel, BertTokenizerFast, get_cosine_schedule_with_warmup
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer


def prepare_cache(karpathy_json, cache_file, tok, max_len):
    with open(karpathy_json) as f:
        images = json.load(f)["images"]
    out = {}
    for split in ("train", "val", "test"):
        keep = {"train", "restval"} if split == "train" else {split}
        ims = [im for im in images if im["split"] in keep]
        caps = [s["raw"].strip().lower() for im in ims for s in im["sentences"]]
        enc = tok(caps, padding="max_length", truncation=True, max_length=max_len, return_tensors="pt")
        out[split] = {"paths": [f"{im['filepath']}/{im['filename']}" for im in ims],
                      "ids": [im["cocoid"] for im in ims],
                      "cap_img": torch.tensor([k for k, im in enumerate(ims) for _ in im["sentences"]]),
                      "tokens": enc.input_ids,
                      "refs": {im["cocoid"]: [s["raw"] for s in im["sentences"]] for im in ims}}
    tmp = cache_file + ".tmp"
    torch.save(out, tmp)
    os.replace(tmp, cache_file)


class CaptionSet(Dataset):
    def __init__(self, cache, root, split, tf):
        self.d, self.root, self.tf, self.train = cache[split], root, tf, split == "train"

    def __len__(self):
        return len(self.d["tokens"]) if self.train else len(self.d["paths"])

    def __getitem__(self, i):
        k = int(self.d["cap_img"][i]) if self.train else i
        img = self.tf(Image.open(os.path.join(self.root, self.d["paths"][k])).convert("RGB"))
        return (img, self.d["tokens"][i]) if self.train else (img, self.d["ids"][k])


class BlipCaptioner(nn.Module):
    def __init__(self, bert="bert-base-uncased", embed_dim=256, grad_ckpt=True):
        super().__init__()
        self.visual = timm.create_model("vit_base_patch16_224.augreg_in21k", pretrained=True, num_classes=0)
        self.grad_ckpt = grad_ckpt
        self.decoder = BertLMHeadModel.from_pretrained(
            bert, config=BertConfig.from_pretrained(bert, is_decoder=True, add_cross_attention=True))
        self.text_encoder = BertModel.from_pretrained(bert, add_pooling_layer=False)
        self.vision_proj = nn.Linear(768, embed_dim)
        self.text_proj = nn.Linear(768, embed_dim)
        self.logit_scale = nn.Parameter(torch.tensor(2.659))  # log(1/0.07)

    def encode_image(self, images):
        v = self.visual
        x = v.norm_pre(v._pos_embed(v.patch_embed(images)))
        for blk in v.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.grad_ckpt and self.training else blk(x)
        return v.norm(x)

    def forward(self, images, ids, attn, with_itc=False):
        img = self.encode_image(images)
        img_mask = torch.ones(img.shape[:2], dtype=torch.long, device=img.device)
        logits = self.decoder(input_ids=ids, attention_mask=attn, encoder_hidden_states=img,
                              encoder_attention_mask=img_mask).logits
        labels = ids[:, 1:].masked_fill(attn[:, 1:] == 0, -100)
        loss = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels, ignore_index=-100, label_smoothing=0.1)
        itc = torch.zeros((), device=images.device)
        if with_itc:
            t = self.text_encoder(input_ids=ids, attention_mask=attn).last_hidden_state[:, 0]
            zi = F.normalize(self.vision_proj(img[:, 0]), dim=-1)
            zt = F.normalize(self.text_proj(t), dim=-1)
            # differentiable gather so negatives come from every GPU
            all_zi = torch.cat(dist_fn.all_gather(zi), 0)
            all_zt = torch.cat(dist_fn.all_gather(zt), 0)
            offset = dist.get_rank() * zi.size(0)
            tgt = torch.arange(zi.size(0), device=zi.device) + offset
            scale = self.logit_scale.exp().clamp(max=100)
            itc = 0.5 * (F.cross_entropy(scale * zi @ all_zt.t(), tgt) + F.cross_entropy(scale * zt @ all_zi.t(), tgt))
        return loss, itc

    @torch.no_grad()
    def greedy(self, images, bos, eos, max_len=30):
        img = self.encode_image(images)
        ids = torch.full((images.size(0), 1), bos, dtype=torch.long, device=images.device)
        for _ in range(max_len):
            nxt = self.decoder(input_ids=ids, encoder_hidden_states=img).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            if (ids == eos).any(1).all():
                break
        return ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="exp/blip_cap_itc")
    ap.add_argument("--resume", default="")
    ap.add_argument("--batch_size", type=int, default=48, help="per GPU")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--itc_every", type=int, default=4)
    ap.add_argument("--itc_weight", type=float, default=0.2)
    ap.add_argument("--max_len", type=int, default=35)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = BertTokenizerFast.from_pretrained("bert-base-uncased")
    cache_file = os.path.join(args.data, f"karpathy_tok_bert_{args.max_len}.pt")
    if rank == 0 and not os.path.exists(cache_file):
        prepare_cache(os.path.join(args.data, "dataset_coco.json"), cache_file, tok, args.max_len)
    dist.barrier()  # the other ranks read the cache only once rank 0 has finished writing it
    cache = torch.load(cache_file)

    norm = transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    train_set = CaptionSet(cache, args.data, "train", transforms.Compose(
        [transforms.RandomResizedCrop(224, scale=(0.5, 1.0)), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    val_set = CaptionSet(cache, args.data, "val", transforms.Compose(
        [transforms.Resize((224, 224)), transforms.ToTensor(), norm]))
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 64, sampler=DistributedSampler(val_set, shuffle=False), num_workers=8)

    model = BlipCaptioner().to(device)
    # text_encoder / projections only receive gradients on ITC steps
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total = len(loader) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, 1000, total)

    start_epoch, step, best = 0, 0, 0.0
    resume = os.path.join(args.out, "last.pt") if args.resume == "auto" else args.resume
    if resume and os.path.exists(resume):
        ckpt = torch.load(resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, step, best = ckpt["epoch"] + 1, ckpt["step"], ckpt["best"]
        del ckpt

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for images, ids in loader:
            images, ids = images.to(device, non_blocking=True), ids.to(device, non_blocking=True)
            attn = (ids != tok.pad_token_id).long()
            with_itc = step % args.itc_every == 0  # same decision on every rank
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lm_loss, itc_loss = model(images, ids, attn, with_itc=with_itc)
            loss = lm_loss + args.itc_weight * itc_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                stats = torch.stack([lm_loss.detach(), itc_loss.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step} lm {stats[0]:.4f} itc {stats[1]:.4f} "
                          f"{(time.time() - t0) / 100:.2f}s/it", flush=True)
                    t0 = time.time()

        model.eval()
        local = {}
        for images, image_ids in val_loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model.module.greedy(images.to(device), tok.cls_token_id, tok.sep_token_id)
            for i, seq in zip(image_ids.tolist(), out.tolist()):
                local[i] = tok.decode(seq, skip_special_tokens=True)
        parts = [None] * world
        dist.all_gather_object(parts, local)
        if rank == 0:
            preds = {k: v for p in parts for k, v in p.items()}
            refs = cache["val"]["refs"]
            ptb = PTBTokenizer()
            gts = ptb.tokenize({k: [{"caption": c} for c in refs[k]] for k in preds})
            res = ptb.tokenize({k: [{"caption": v}] for k, v in preds.items()})
            cider = Cider().compute_score(gts, res)[0]
            bleu4 = Bleu(4).compute_score(gts, res)[0][3]
            print(f"epoch {epoch}: CIDEr {cider:.4f} BLEU-4 {bleu4:.4f} ({len(preds)} images)", flush=True)
            best = max(best, cider)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step, "best": best},
                       os.path.join(args.out, "last.pt"))
            if cider >= best:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
