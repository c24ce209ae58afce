"""BLIP-2 style Q-Former pre-training (image-text contrastive part only).

A frozen CLIP ViT-L/14 provides patch features; 32 learned queries cross-attend to them.
Image-text similarity is the max over queries of query/text cosine similarity.

    torchrun --nproc_per_node=8 15_qformer_itc_pretrain.py --train-json /data/blip2/ccs_filtered.json
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertModel, BertTokenizerFast, CLIPImageProcessor, CLIPVisionModel


def parse_args():
    parser = argparse.ArgumentParser(description="Q-Former ITC pre-training")
    parser.add_argument("--train-json", required=True)
    parser.add_argument("--image-root", default="/data/blip2/images")
    parser.add_argument("--vision", default="openai/clip-vit-large-patch14")
    parser.add_argument("--bert", default="bert-base-uncased")
    parser.add_argument("--num-queries", type=int, default=32)
    parser.add_argument("--qformer-layers", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--wd", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=5000)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--output-dir", default="/shared/blip2/qformer_itc")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class PairJson(Dataset):
    def __init__(self, path, root, processor):
        with open(path) as f:
            self.ann = json.load(f)
        self.root, self.processor = root, processor

    def __len__(self):
        return len(self.ann)

    def __getitem__(self, idx):
        a = self.ann[idx]
        img = Image.open(os.path.join(self.root, a["image"])).convert("RGB")
        return self.processor(img, return_tensors="pt").pixel_values[0], a["caption"]


class QFormerITC(nn.Module):
    def __init__(self, vision_name, bert_name, num_queries, layers, embed_dim=256):
        super().__init__()
        self.vision = CLIPVisionModel.from_pretrained(vision_name)
        self.vision.requires_grad_(False)
        vdim = self.vision.config.hidden_size
        self.text = BertModel.from_pretrained(bert_name, add_pooling_layer=False)
        hdim = self.text.config.hidden_size
        self.query_tokens = nn.Parameter(torch.zeros(1, num_queries, hdim).normal_(std=0.02))
        self.vis_in = nn.Linear(vdim, hdim)
        layer = nn.TransformerDecoderLayer(hdim, 12, 4 * hdim, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=False)
        self.qformer = nn.TransformerDecoder(layer, layers)
        self.vision_proj = nn.Linear(hdim, embed_dim)
        self.text_proj = nn.Linear(hdim, embed_dim)
        self.temp = nn.Parameter(0.07 * torch.ones([]))

    def train(self, mode=True):
        super().train(mode)
        self.vision.eval()
        return self

    def forward(self, pixel_values, input_ids, attention_mask):
        with torch.no_grad():
            patches = self.vision(pixel_values=pixel_values).last_hidden_state
        memory = self.vis_in(patches)
        queries = self.query_tokens.expand(pixel_values.shape[0], -1, -1)
        q = self.qformer(queries, memory)
        img_feats = F.normalize(self.vision_proj(q), dim=-1)               # B x Q x D
        txt = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        txt_feat = F.normalize(self.text_proj(txt[:, 0]), dim=-1)          # B x D
        return img_feats, txt_feat, self.temp


def itc_loss(img_feats, txt_feat, temp):
    rank = dist.get_rank()
    all_img = torch.cat(dist_nn.all_gather(img_feats))    # N x Q x D
    all_txt = torch.cat(dist_nn.all_gather(txt_feat))     # N x D
    # image -> text: max over queries
    sim_i2t = torch.einsum("bqd,nd->bqn", img_feats, all_txt).max(dim=1).values / temp
    sim_t2i = torch.einsum("bd,nqd->bnq", txt_feat, all_img).max(dim=-1).values / temp
    bs = img_feats.shape[0]
    targets = torch.arange(bs, device=img_feats.device) + rank * bs
    return (F.cross_entropy(sim_i2t, targets, label_smoothing=0.1) +
            F.cross_entropy(sim_t2i, targets, label_smoothing=0.1)) / 2


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(42)

    processor = CLIPImageProcessor.from_pretrained(args.vision)
    tokenizer = BertTokenizerFast.from_pretrained(args.bert)
    model = QFormerITC(args.vision, args.bert, args.num_queries, args.qformer_layers).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    dataset = PairJson(args.train_json, args.image_root, processor)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.999))
    total = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / args.warmup_steps if s < args.warmup_steps
        else 0.5 * (1 + math.cos(math.pi * (s - args.warmup_steps) / (total - args.warmup_steps))))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for i, (pixels, captions) in enumerate(loader):
            pixels = pixels.to(device, non_blocking=True)
            tok = tokenizer(list(captions), padding="longest", truncation=True, max_length=32,
                            return_tensors="pt").to(device)
            with torch.no_grad():
                model.module.temp.clamp_(0.001, 0.5)
            with torch.autocast("cuda", dtype=torch.float16):
                img_feats, txt_feat, temp = model(pixels, tok.input_ids, tok.attention_mask)
            loss = itc_loss(img_feats.float(), txt_feat.float(), temp.float())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and i % 50 == 0:
                print(f"epoch {epoch} [{i}/{len(loader)}] itc {loss.item():.4f} temp {model.module.temp.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - start) / (i + 1):.2f}s/it", flush=True)

        if rank == 0:
            trainable = {k: v for k, v in model.module.state_dict().items() if not k.startswith("vision.")}
            torch.save({"model": trainable, "epoch": epoch},
                       os.path.join(args.output_dir, f"checkpoint_{epoch:02d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
