"""BLIP-2 stage-1 representation learning: train a Q-Former against a frozen ViT-g
with the three stage-1 objectives (ITC, ITM, ITG) on CC3M + COCO captions.

    torchrun --nproc_per_node=8 01_blip2_qformer_stage1.py \
        --ann /data/blip2/pretrain_ann.json --image-root /data/blip2/images --out ckpt/qformer_s1
"""
import argparse
import json
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import BertConfig, BertModel, BertTokenizerFast


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ann", required=True)
    p.add_argument("--image-root", required=True)
    p.add_argument("--out", default="ckpt/qformer_s1")
    p.add_argument("--vit", default="eva_giant_patch14_224.clip_ft_in1k")
    p.add_argument("--bert", default="bert-base-uncased")
    p.add_argument("--num-query", type=int, default=32)
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--min-lr", type=float, default=1e-5)
    p.add_argument("--warmup-steps", type=int, default=5000)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--itg-every", type=int, default=2,
                   help="run the captioning (ITG) branch every N steps; it is the slowest of the three")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--max-txt-len", type=int, default=32)
    return p.parse_args()


class CaptionDataset(Dataset):
    def __init__(self, ann_file, image_root, max_words=32):
        with open(ann_file) as f:
            self.ann = json.load(f)
        self.image_root = image_root
        self.max_words = max_words
        self.transform = transforms.Compose([
            transforms.RandomResizedCrop(224, scale=(0.5, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        ])

    def __len__(self):
        return len(self.ann)

    def __getitem__(self, idx):
        a = self.ann[idx]
        img = Image.open(os.path.join(self.image_root, a["image"])).convert("RGB")
        caption = " ".join(a["caption"].lower().strip().split()[: self.max_words])
        return self.transform(img), caption


class QFormer(nn.Module):
    def __init__(self, bert_name, vision_width, num_query, embed_dim):
        super().__init__()
        cfg = BertConfig.from_pretrained(bert_name)
        cfg.encoder_width = vision_width
        cfg.add_cross_attention = True
        cfg.is_decoder = False
        self.bert = BertModel.from_pretrained(bert_name, config=cfg, add_pooling_layer=False)
        self.query_tokens = nn.Parameter(torch.zeros(1, num_query, cfg.hidden_size))
        nn.init.normal_(self.query_tokens, std=cfg.initializer_range)
        self.vision_ln = nn.LayerNorm(vision_width)
        self.vision_proj = nn.Linear(cfg.hidden_size, embed_dim)
        self.text_proj = nn.Linear(cfg.hidden_size, embed_dim)
        self.itm_head = nn.Linear(cfg.hidden_size, 2)
        self.lm_head = nn.Sequential(
            nn.Linear(cfg.hidden_size, cfg.hidden_size), nn.GELU(), nn.LayerNorm(cfg.hidden_size),
            nn.Linear(cfg.hidden_size, cfg.vocab_size),
        )
        self.temp = nn.Parameter(torch.tensor(0.07))

    def query_features(self, image_embeds):
        image_embeds = self.vision_ln(image_embeds)
        atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        q = self.query_tokens.expand(image_embeds.size(0), -1, -1)
        out = self.bert(inputs_embeds=q, encoder_hidden_states=image_embeds, encoder_attention_mask=atts)
        return out.last_hidden_state, image_embeds, atts

    def forward(self, image_embeds, text, run_itg):
        q_out, image_embeds, image_atts = self.query_features(image_embeds)
        img_feats = F.normalize(self.vision_proj(q_out), dim=-1)                  # B, Q, D
        t_out = self.bert(input_ids=text.input_ids, attention_mask=text.attention_mask)
        txt_feat = F.normalize(self.text_proj(t_out.last_hidden_state[:, 0]), dim=-1)

        # ---- ITC (in-batch; max over queries) ----
        with torch.no_grad():
            self.temp.clamp_(0.001, 0.5)
        sim_i2t = torch.einsum("iqd,td->itq", img_feats, txt_feat).max(-1).values / self.temp
        sim_t2i = sim_i2t.t()
        targets = torch.arange(sim_i2t.size(0), device=sim_i2t.device)
        loss_itc = (F.cross_entropy(sim_i2t, targets, label_smoothing=0.1)
                    + F.cross_entropy(sim_t2i, targets, label_smoothing=0.1)) / 2

        # ---- ITM with hard negatives ----
        bs = image_embeds.size(0)
        with torch.no_grad():
            w_t2i = F.softmax(sim_t2i.float(), dim=1) + 1e-4
            w_t2i.fill_diagonal_(0)
            w_i2t = F.softmax(sim_i2t.float(), dim=1) + 1e-4
            w_i2t.fill_diagonal_(0)
        neg_img_idx = torch.multinomial(w_t2i, 1).squeeze(1)
        neg_txt_idx = torch.multinomial(w_i2t, 1).squeeze(1)
        ids_all = torch.cat([text.input_ids, text.input_ids, text.input_ids[neg_txt_idx]], 0)
        mask_all = torch.cat([text.attention_mask, text.attention_mask, text.attention_mask[neg_txt_idx]], 0)
        img_all = torch.cat([image_embeds, image_embeds[neg_img_idx], image_embeds], 0)
        q = self.query_tokens.expand(ids_all.size(0), -1, -1)
        q_att = torch.ones(q.shape[:-1], dtype=torch.long, device=q.device)
        emb = self.bert.embeddings(input_ids=ids_all)
        itm_out = self.bert(
            inputs_embeds=torch.cat([q, emb], 1),
            attention_mask=torch.cat([q_att, mask_all], 1),
            encoder_hidden_states=img_all,
            encoder_attention_mask=torch.ones(img_all.shape[:-1], dtype=torch.long, device=q.device),
        ).last_hidden_state[:, : q.size(1)]
        itm_logits = self.itm_head(itm_out).mean(1)
        itm_labels = torch.cat([torch.ones(bs), torch.zeros(2 * bs)]).long().to(q.device)
        loss_itm = F.cross_entropy(itm_logits, itm_labels)

        # ---- ITG: caption conditioned on queries ----
        loss_itg = torch.zeros((), device=q.device)
        if run_itg:
            dec_emb = self.bert.embeddings(input_ids=text.input_ids)
            nq, nt = q_out.size(1), text.input_ids.size(1)
            # queries see queries only; text sees all queries + causal text (UniLM-style mask)
            mask = torch.zeros(bs, nq + nt, nq + nt, dtype=torch.long, device=q.device)
            mask[:, :nq, :nq] = 1
            mask[:, nq:, :nq] = 1
            mask[:, nq:, nq:] = torch.tril(torch.ones(nt, nt, dtype=torch.long, device=q.device))
            mask[:, :, nq:] *= text.attention_mask[:, None, :]
            hid = self.bert(
                inputs_embeds=torch.cat([q_out, dec_emb], 1), attention_mask=mask,
            ).last_hidden_state[:, nq:]
            logits = self.lm_head(hid)[:, :-1]
            labels = text.input_ids[:, 1:].masked_fill(text.attention_mask[:, 1:] == 0, -100)
            loss_itg = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                       ignore_index=-100, label_smoothing=0.1)
        return loss_itc, loss_itm, loss_itg


def cosine_lr(step, total, warmup, base, minimum):
    if step < warmup:
        return base * step / max(1, warmup)
    t = (step - warmup) / max(1, total - warmup)
    return minimum + 0.5 * (base - minimum) * (1 + math.cos(math.pi * t))


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42 + rank)

    vit = timm.create_model(args.vit, pretrained=True, num_classes=0)
    vit.requires_grad_(False).eval().to(device, dtype=torch.float16)

    tokenizer = BertTokenizerFast.from_pretrained(args.bert, truncation_side="right")
    qformer = QFormer(args.bert, vit.num_features, args.num_query, args.embed_dim).to(device)
    model = DDP(qformer, device_ids=[local_rank])

    ds = CaptionDataset(args.ann, args.image_root, args.max_txt_len)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "query_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "query_tokens" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98))
    scaler = torch.cuda.amp.GradScaler()
    total_steps = args.epochs * len(loader)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} steps/epoch={len(loader)} total={total_steps}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for images, captions in loader:
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, total_steps, args.warmup_steps, args.lr, args.min_lr)
            images = images.to(device, non_blocking=True)
            text = tokenizer(captions, padding="max_length", truncation=True,
                             max_length=args.max_txt_len, return_tensors="pt").to(device)
            with torch.no_grad():
                image_embeds = vit.forward_features(images.half()).float()
            with torch.autocast("cuda", dtype=torch.float16):
                l_itc, l_itm, l_itg = model(image_embeds, text, run_itg=(step % args.itg_every == 0))
                loss = l_itc + l_itm + l_itg
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

            if step % 50 == 0:
                stats = torch.stack([l_itc.detach(), l_itm.detach(), l_itg.detach()])
                dist.all_reduce(stats)
                stats /= world
                if rank == 0:
                    print(f"ep {epoch} step {step} itc {stats[0]:.3f} itm {stats[1]:.3f} itg {stats[2]:.3f} "
                          f"lr {opt.param_groups[0]['lr']:.2e} {(time.time() - t0) / 50:.2f}s/it", flush=True)
                    t0 = time.time()
            step += 1

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "epoch": epoch, "step": step},
                       os.path.join(args.out, f"checkpoint_{epoch:02d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
