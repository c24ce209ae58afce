"""ViT-B/16 + BERT decoder (cross-attention) captioning on COCO Karpathy.

Captions are tokenised once and kept in a .pt cache next to the data.

torchrun --nproc_per_node=8 10_coco_caption_tokcache.py --cfg cfg/coco_vitb_bertdec.json
"""
import argparse
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

import timm
from transformers import BertConfig, BertLMHeadModel, BertTokenizerFast, get_cosine_schedule_with_warmup
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer


@dataclass
class Config:
    karpathy_json: str = "/data/coco/dataset_coco.json"
    image_root: str = "/data/coco"
    cache_dir: str = "/data/coco/cache"
    output_dir: str = "work_dirs/vitb_bertdec"
    vit: str = "vit_base_patch16_224.augreg2_in21k_ft_in1k"
    bert: str = "bert-base-uncased"
    prompt: str = "a picture of "
    max_len: int = 30
    batch_size: int = 64          # per GPU (8 GPUs)
    epochs: int = 8
    lr: float = 1e-4
    vit_lr: float = 2e-5
    warmup_steps: int = 2000
    label_smoothing: float = 0.1
    num_workers: int = 8
    milestones: list = field(default_factory=list)


class CocoCaptionDataset(Dataset):
    def __init__(self, cfg, split, tokenizer, transform):
        self.cfg, self.split, self.transform = cfg, split, transform
        cache_file = os.path.join(cfg.cache_dir, f"coco_{split}_{cfg.bert}_{cfg.max_len}.pt")
        if os.path.exists(cache_file):
            data = torch.load(cache_file)
        else:
            data = self._build(tokenizer)
            os.makedirs(cfg.cache_dir, exist_ok=True)
            torch.save(data, cache_file)
        self.paths = data["paths"]
        self.image_ids = data["image_ids"]
        self.input_ids = data["input_ids"]
        self.refs = data["refs"]
        self.item_to_image = data["item_to_image"]

    def _build(self, tokenizer):
        with open(self.cfg.karpathy_json) as f:
            images = json.load(f)["images"]
        keep = {"train", "restval"} if self.split == "train" else {self.split}
        images = [im for im in images if im["split"] in keep]
        paths = [os.path.join(im["filepath"], im["filename"]) for im in images]
        refs = {im["cocoid"]: [s["raw"].strip() for s in im["sentences"]] for im in images}
        caps, item_to_image = [], []
        for idx, im in enumerate(images):
            for s in im["sentences"]:
                caps.append(self.cfg.prompt + s["raw"].strip().lower())
                item_to_image.append(idx)
        enc = tokenizer(caps, padding="max_length", truncation=True, max_length=self.cfg.max_len,
                        return_tensors="pt")
        return {"paths": paths, "image_ids": [im["cocoid"] for im in images], "input_ids": enc.input_ids,
                "refs": refs, "item_to_image": torch.tensor(item_to_image)}

    def __len__(self):
        return len(self.input_ids) if self.split == "train" else len(self.paths)

    def __getitem__(self, i):
        img_idx = int(self.item_to_image[i]) if self.split == "train" else i
        image = Image.open(os.path.join(self.cfg.image_root, self.paths[img_idx])).convert("RGB")
        image = self.transform(image)
        if self.split == "train":
            return image, self.input_ids[i]
        return image, self.image_ids[img_idx]


class ViTBertCaptioner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.visual = timm.create_model(cfg.vit, pretrained=True, num_classes=0, drop_path_rate=0.1)
        dec_cfg = BertConfig.from_pretrained(cfg.bert, is_decoder=True, add_cross_attention=True)
        self.decoder = BertLMHeadModel.from_pretrained(cfg.bert, config=dec_cfg)

    def forward(self, images, input_ids, attention_mask):
        img = self.visual.forward_features(images)
        img_mask = torch.ones(img.shape[:2], dtype=torch.long, device=img.device)
        return self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                            encoder_hidden_states=img, encoder_attention_mask=img_mask).logits

    @torch.no_grad()
    def greedy(self, images, prompt_ids, eos_id, max_len):
        img = self.visual.forward_features(images)
        img_mask = torch.ones(img.shape[:2], dtype=torch.long, device=img.device)
        ids = prompt_ids.expand(images.size(0), -1).clone()
        for _ in range(max_len - ids.size(1)):
            logits = self.decoder(input_ids=ids, encoder_hidden_states=img, encoder_attention_mask=img_mask).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
            if (ids == eos_id).any(1).all():
                break
        return ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cfg = Config()
    cli = ap.parse_args()
    if cli.cfg:
        cfg = Config(**{**asdict(cfg), **json.load(open(cli.cfg))})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format=f"%(asctime)s [rank{rank}] %(message)s")
    logger = logging.getLogger("cap")

    tokenizer = BertTokenizerFast.from_pretrained(cfg.bert)
    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.5, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                   transforms.Normalize(mean, std)])
    test_tf = transforms.Compose([transforms.Resize((224, 224)), transforms.ToTensor(),
                                  transforms.Normalize(mean, std)])
    train_set = CocoCaptionDataset(cfg, "train", tokenizer, train_tf)
    val_set = CocoCaptionDataset(cfg, "val", tokenizer, test_tf)
    logger.info("train captions %d, val images %d", len(train_set), len(val_set))

    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=cfg.num_workers, pin_memory=True)

    model = ViTBertCaptioner(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW([
        {"params": model.module.visual.parameters(), "lr": cfg.vit_lr},
        {"params": model.module.decoder.parameters(), "lr": cfg.lr},
    ], weight_decay=0.05)
    total_steps = cfg.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, total_steps)

    prompt_ids = tokenizer(cfg.prompt, return_tensors="pt").input_ids[:, :-1].to(device)  # drop [SEP]
    n_prompt = prompt_ids.size(1)
    best, step = 0.0, 0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for images, input_ids in train_loader:
            images, input_ids = images.to(device, non_blocking=True), input_ids.to(device, non_blocking=True)
            attn = (input_ids != tokenizer.pad_token_id).long()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(images, input_ids, attn)
            targets = input_ids[:, 1:].masked_fill(attn[:, 1:] == 0, -100)
            targets[:, :n_prompt - 1] = -100  # no loss on the prompt
            loss = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), targets,
                                   ignore_index=-100, label_smoothing=cfg.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l)
                logger.info("ep %d step %d loss %.4f (%.1f it/s)", epoch, step, l.item() / world,
                            100 / (time.time() - t0))
                t0 = time.time()

        model.eval()
        local = {}
        for images, image_ids in val_loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model.module.greedy(images.to(device), prompt_ids, tokenizer.sep_token_id, cfg.max_len)
            for iid, seq in zip(image_ids.tolist(), out[:, n_prompt:].tolist()):
                local[iid] = tokenizer.decode(seq, skip_special_tokens=True)
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
        if rank == 0:
            preds = {k: v for g in gathered for k, v in g.items()}
            ptb = PTBTokenizer()
            gts = ptb.tokenize({k: [{"caption": c} for c in val_set.refs[k]] for k in preds})
            res = ptb.tokenize({k: [{"caption": v}] for k, v in preds.items()})
            bleu, _ = Bleu(4).compute_score(gts, res)
            cider, _ = Cider().compute_score(gts, res)
            logger.info("epoch %d: BLEU-4 %.4f CIDEr %.4f (%d images)", epoch, bleu[3], cider, len(preds))
            os.makedirs(cfg.output_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "cfg": asdict(cfg), "epoch": epoch},
                       os.path.join(cfg.output_dir, "last.pth"))
            if cider > best:
                best = cider
                torch.save({"model": model.module.state_dict(), "cfg": asdict(cfg)},
                           os.path.join(cfg.output_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
