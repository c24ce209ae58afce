# -*- coding: utf-8 -*-
"""
TrOCR 手写 / 票据文本行识别微调 (transformers VisionEncoderDecoderModel)
torchrun --nproc_per_node=4 finetune_trocr.py --config configs/trocr_invoice.yaml
"""
import os
import time
import argparse
import logging

import yaml
import torch
import torch.distributed as dist
from PIL import Image
from easydict import EasyDict
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import TrOCRProcessor, VisionEncoderDecoderModel, get_cosine_schedule_with_warmup

logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s", level=logging.INFO)
logger = logging.getLogger(__name__)


def edit_distance(a, b):
    dp = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, dp[0] = dp[0], i
        for j in range(1, len(b) + 1):
            cur = dp[j]
            dp[j] = min(dp[j] + 1, dp[j - 1] + 1, prev + (a[i - 1] != b[j - 1]))
            prev = cur
    return dp[-1]


class OCRLineDataset(Dataset):
    """标注文件每行: 相对路径\\t文本"""

    def __init__(self, root, ann_file, processor, max_len=64):
        self.root, self.processor, self.max_len = root, processor, max_len
        with open(ann_file, encoding="utf-8") as f:
            self.samples = [l.rstrip("\n").split("\t", 1) for l in f if "\t" in l]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, text = self.samples[idx]
        image = Image.open(os.path.join(self.root, path)).convert("RGB")
        pixel_values = self.processor(images=image, return_tensors="pt").pixel_values[0]
        labels = self.processor.tokenizer(text, padding="max_length", truncation=True,
                                          max_length=self.max_len).input_ids
        labels = [l if l != self.processor.tokenizer.pad_token_id else -100 for l in labels]
        return {"pixel_values": pixel_values, "labels": torch.tensor(labels), "text": text}


def collate(batch):
    return {"pixel_values": torch.stack([b["pixel_values"] for b in batch]),
            "labels": torch.stack([b["labels"] for b in batch]),
            "text": [b["text"] for b in batch]}


@torch.no_grad()
def evaluate(model, loader, processor, device):
    model.eval()
    stat = torch.zeros(4, device=device)  # 编辑距离, 字符数, 整行正确数, 行数
    for batch in loader:
        gen = model.module.generate(batch["pixel_values"].to(device), max_new_tokens=64, num_beams=1)
        preds = processor.batch_decode(gen, skip_special_tokens=True)
        for p, t in zip(preds, batch["text"]):
            stat[0] += edit_distance(p, t)
            stat[1] += max(len(t), 1)
            stat[2] += float(p == t)
            stat[3] += 1
    dist.all_reduce(stat)
    model.train()
    return (stat[0] / stat[1]).item(), (stat[2] / stat[3]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/trocr_invoice.yaml")
    args = parser.parse_args()
    with open(args.config, encoding="utf-8") as f:
        cfg = EasyDict(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank != 0:
        logger.setLevel(logging.WARNING)
    torch.manual_seed(cfg.seed)

    processor = TrOCRProcessor.from_pretrained(cfg.pretrained)
    model = VisionEncoderDecoderModel.from_pretrained(cfg.pretrained)
    model.config.decoder_start_token_id = processor.tokenizer.cls_token_id
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.eos_token_id = processor.tokenizer.sep_token_id
    model.to(device)
    # encoder 的 pooler 不参与 loss 计算, 需要打开 find_unused_parameters
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    train_set = OCRLineDataset(cfg.data_root, cfg.train_ann, processor, cfg.max_len)
    val_set = OCRLineDataset(cfg.data_root, cfg.val_ann, processor, cfg.max_len)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True,
                              num_workers=cfg.workers, collate_fn=collate, pin_memory=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=False)
    val_loader = DataLoader(val_set, batch_size=cfg.batch_size, sampler=val_sampler,
                            num_workers=cfg.workers, collate_fn=collate)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    total_steps = cfg.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.05 * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler()

    best_cer = 1e9
    step = 0
    for epoch in range(cfg.epochs):
        model.train()
        t0 = time.time()
        for batch in train_loader:
            pixel_values = batch["pixel_values"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(pixel_values=pixel_values, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if step % cfg.log_steps == 0:
                loss_avg = loss.detach().clone()
                dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d/%d loss %.4f lr %.2e (%.1fs)", epoch, step, total_steps,
                            loss_avg.item(), scheduler.get_last_lr()[0], time.time() - t0)
                t0 = time.time()

        cer, line_acc = evaluate(model, val_loader, processor, device)
        logger.info("epoch %d 验证 CER %.4f 行准确率 %.4f", epoch, cer, line_acc)
        if rank == 0 and cer < best_cer:
            best_cer = cer
            save_dir = os.path.join(cfg.output_dir, "best")
            model.module.save_pretrained(save_dir)
            processor.save_pretrained(save_dir)
            logger.info("保存最优模型到 %s", save_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
