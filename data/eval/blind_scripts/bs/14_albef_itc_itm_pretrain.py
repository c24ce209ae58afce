"""ALBEF-style pretraining: image-text contrastive (ITC) + image-text matching (ITM)
with in-batch hard negatives, on CC3M + SBU jsonl.

    torchrun --nproc_per_node=8 14_albef_itc_itm_pretrain.py --train-file data/cc3m_sbu.jsonl --output-dir out/albef
"""
import argparse
import json
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import BertModel, BertTokenizerFast


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-file", required=True)
    parser.add_argument("--output-dir", default="out/albef")
    parser.add_argument("--vit", default="vit_base_patch16_224.augreg_in21k")
    parser.add_argument("--bert", default="bert-base-uncased")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--embed-dim", type=int, default=256)
    parser.add_argument("--temp", type=float, default=0.07)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class PairJsonl(Dataset):
    def __init__(self, path, transform):
        self.rows = [json.loads(l) for l in open(path)]
        self.transform = transform

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return self.transform(Image.open(r["image"]).convert("RGB")), r["caption"]


class ALBEFLite(nn.Module):
    def __init__(self, vit_name, bert_name, embed_dim, temp):
        super().__init__()
        self.visual = timm.create_model(vit_name, pretrained=True, num_classes=0)
        self.text = BertModel.from_pretrained(bert_name, add_pooling_layer=False)
        width = self.text.config.hidden_size
        self.vis_to_txt = nn.Linear(self.visual.num_features, width)
        self.vision_proj = nn.Linear(width, embed_dim)
        self.text_proj = nn.Linear(width, embed_dim)
        layer = nn.TransformerEncoderLayer(width, 12, 4 * width, batch_first=True, norm_first=True)
        self.fusion = nn.TransformerEncoder(layer, num_layers=6)
        self.itm_head = nn.Linear(width, 2)
        self.temp = nn.Parameter(torch.tensor(temp))

    def fuse(self, img_tokens, txt_tokens, txt_mask):
        x = torch.cat([txt_tokens, img_tokens], 1)
        pad = torch.cat([txt_mask == 0, torch.zeros(img_tokens.shape[:2], dtype=torch.bool, device=x.device)], 1)
        return self.fusion(x, src_key_padding_mask=pad)[:, 0]

    def forward(self, images, input_ids, attention_mask):
        img_tokens = self.vis_to_txt(self.visual.forward_features(images))
        txt_tokens = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        img_feat = F.normalize(self.vision_proj(img_tokens[:, 0]), dim=-1)
        txt_feat = F.normalize(self.text_proj(txt_tokens[:, 0]), dim=-1)

        # ITC over the global batch
        temp = self.temp.clamp(0.001, 0.5)
        all_img = torch.cat(torch.distributed.nn.all_gather(img_feat))
        all_txt = torch.cat(torch.distributed.nn.all_gather(txt_feat))
        sim_i2t = img_feat @ all_txt.t() / temp
        sim_t2i = txt_feat @ all_img.t() / temp
        bs = images.size(0)
        targets = torch.arange(bs, device=images.device) + dist.get_rank() * bs
        loss_itc = (F.cross_entropy(sim_i2t, targets) + F.cross_entropy(sim_t2i, targets)) / 2

        # ITM: positives + one hard negative text per image and one hard negative image per text
        with torch.no_grad():
            local_i2t = F.softmax(img_feat @ txt_feat.t() / temp, dim=1) + 1e-5
            local_t2i = F.softmax(txt_feat @ img_feat.t() / temp, dim=1) + 1e-5
            local_i2t.fill_diagonal_(0)
            local_t2i.fill_diagonal_(0)
            neg_txt_idx = torch.multinomial(local_i2t, 1).squeeze(1)
            neg_img_idx = torch.multinomial(local_t2i, 1).squeeze(1)
        img_all = torch.cat([img_tokens, img_tokens, img_tokens[neg_img_idx]])
        txt_all = torch.cat([txt_tokens, txt_tokens[neg_txt_idx], txt_tokens])
        mask_all = torch.cat([attention_mask, attention_mask[neg_txt_idx], attention_mask])
        itm_logits = self.itm_head(self.fuse(img_all, txt_all, mask_all))
        itm_labels = torch.cat([torch.ones(bs), torch.zeros(2 * bs)]).long().to(images.device)
        loss_itm = F.cross_entropy(itm_logits, itm_labels)
        return loss_itc, loss_itm


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    transform = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.5, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ])
    tokenizer = BertTokenizerFast.from_pretrained(args.bert)
    dataset = PairJsonl(args.train_file, transform)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)

    model = ALBEFLite(args.vit, args.bert, args.embed_dim, args.temp).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.02)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{len(dataset)} pairs, {len(loader)} iters/epoch on {world_size} GPUs")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        meter = torch.zeros(3, device=device)
        for it, (images, captions) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            tok = tokenizer(captions, padding="longest", truncation=True, max_length=30, return_tensors="pt").to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss_itc, loss_itm = model(images, tok.input_ids, tok.attention_mask)
                loss = loss_itc + loss_itm
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            meter += torch.stack([loss_itc.detach().float(), loss_itm.detach().float(), torch.ones((), device=device)])
            if it % 100 == 0:
                dist.all_reduce(meter)
                if rank == 0:
                    print(f"[{epoch}][{it}/{len(loader)}] itc {meter[0] / meter[2]:.4f} itm {meter[1] / meter[2]:.4f} "
                          f"lr {optimizer.param_groups[0]['lr']:.2e} {time.time() - start:.0f}s", flush=True)
                meter.zero_()
        scheduler.step()

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "config": vars(args)},
                       os.path.join(args.output_dir, f"checkpoint_{epoch:02d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
