"""Image-text retrieval with contrastive alignment (ITC) and an image-text matching head (ITM)
trained on hard negatives mined from the similarity matrix of the gathered batch.

The towers are first aligned with ITC alone; ITM on mined hard negatives is switched on from
--itm-start-epoch.

torchrun --nproc_per_node=8 20_itc_itm_hardneg_warmup.py --train-json data/cc_sbu_coco_train.json \
    --val-json data/coco_val5k_pairs.json --image-root /data/images --out out/itc_itm
"""
import argparse
import json
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from transformers import BertModel, BertTokenizerFast


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-json", required=True)
    p.add_argument("--val-json", required=True)
    p.add_argument("--image-root", required=True)
    p.add_argument("--out", default="out/itc_itm")
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4, help="for a global batch of 512")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--itm-start-epoch", type=int, default=1)
    p.add_argument("--itm-weight", type=float, default=1.0)
    p.add_argument("--fusion-layers", type=int, default=4)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class Pairs(Dataset):
    def __init__(self, path, root, tf):
        with open(path) as f:
            self.items = json.load(f)
        self.root, self.tf = root, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        return self.tf(Image.open(os.path.join(self.root, it["image"])).convert("RGB")), it["caption"], i


class ITCITM(nn.Module):
    def __init__(self, n_fusion, dim=256):
        super().__init__()
        self.vit = timm.create_model("vit_base_patch16_224.augreg2_in21k_ft_in1k", pretrained=True, num_classes=0)
        self.bert = BertModel.from_pretrained("bert-base-uncased", add_pooling_layer=False)
        width = self.bert.config.hidden_size
        self.img_proj = nn.Linear(self.vit.num_features, dim)
        self.txt_proj = nn.Linear(width, dim)
        self.logit_scale = nn.Parameter(torch.tensor(2.659))  # log(1/0.07)
        layer = nn.TransformerDecoderLayer(width, nhead=12, dim_feedforward=4 * width, batch_first=True,
                                           norm_first=True)
        self.fusion = nn.TransformerDecoder(layer, num_layers=n_fusion)
        self.itm_head = nn.Linear(width, 2)

    def image_tokens(self, x):
        return self.vit.forward_features(x)  # [B, 1 + N, C]

    def text_tokens(self, ids, mask):
        return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state

    def embed(self, img_tok, txt_tok):
        img = F.normalize(self.img_proj(img_tok[:, 0]), dim=-1)
        txt = F.normalize(self.txt_proj(txt_tok[:, 0]), dim=-1)
        return img, txt

    def match_logits(self, txt_tok, txt_mask, img_tok):
        h = self.fusion(tgt=txt_tok, memory=img_tok, tgt_key_padding_mask=~txt_mask.bool())
        return self.itm_head(h[:, 0])

    def forward(self, x, ids, mask, use_itm):
        img_tok, txt_tok = self.image_tokens(x), self.text_tokens(ids, mask)
        img, txt = self.embed(img_tok, txt_tok)
        rank, n = dist.get_rank(), img.shape[0]
        all_img, all_txt = gather(img), gather(txt)
        all_img[rank * n:(rank + 1) * n] = img
        all_txt[rank * n:(rank + 1) * n] = txt
        scale = self.logit_scale.exp().clamp(max=100)
        tgt = torch.arange(n, device=x.device) + rank * n
        s_i2t, s_t2i = scale * img @ all_txt.T, scale * txt @ all_img.T
        loss_itc = 0.5 * (F.cross_entropy(s_i2t, tgt) + F.cross_entropy(s_t2i, tgt))
        if not use_itm:
            return loss_itc, loss_itc.new_zeros(())

        # hard negatives from the local block of the similarity matrix
        with torch.no_grad():
            w_i2t = F.softmax(s_i2t[:, rank * n:(rank + 1) * n].float(), dim=1).fill_diagonal_(0) + 1e-6
            w_t2i = F.softmax(s_t2i[:, rank * n:(rank + 1) * n].float(), dim=1).fill_diagonal_(0) + 1e-6
            neg_txt = torch.multinomial(w_i2t, 1).squeeze(1)
            neg_img = torch.multinomial(w_t2i, 1).squeeze(1)
        t_tok = torch.cat([txt_tok, txt_tok, txt_tok[neg_txt]])
        t_mask = torch.cat([mask, mask, mask[neg_txt]])
        i_tok = torch.cat([img_tok, img_tok[neg_img], img_tok])
        logits = self.match_logits(t_tok, t_mask, i_tok)
        labels = torch.cat([torch.ones(n), torch.zeros(2 * n)]).long().to(x.device)
        return loss_itc, F.cross_entropy(logits, labels)


def gather(t):
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.detach().contiguous())
    return torch.cat(out)


@torch.no_grad()
def evaluate(model, ds, tok, device, workers, ks=(1, 5, 10)):
    model.eval()
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=128, sampler=sampler, num_workers=workers)
    ims, txs, ix = [], [], []
    for x, caps, i in loader:
        enc = tok(list(caps), padding=True, truncation=True, max_length=40, return_tensors="pt").to(device)
        im, tx = model.embed(model.image_tokens(x.to(device)), model.text_tokens(enc.input_ids, enc.attention_mask))
        ims.append(im)
        txs.append(tx)
        ix.append(i.to(device))
    ix = gather(torch.cat(ix))
    img = torch.zeros(len(ds), ims[0].shape[1], device=device)
    txt = torch.zeros_like(img)
    img[ix], txt[ix] = gather(torch.cat(ims)), gather(torch.cat(txs))
    image_key = [it["image"] for it in ds.items]
    uniq = {k: j for j, k in enumerate(dict.fromkeys(image_key))}
    owner = torch.tensor([uniq[k] for k in image_key], device=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    q = torch.arange(rank, len(ds), world, device=device)
    top = (txt[q] @ img.T).topk(max(ks), dim=1).indices
    hit = owner[top] == owner[q][:, None]
    c = torch.tensor([float(hit[:, :k].any(1).sum()) for k in ks] + [float(len(q))], device=device)
    dist.all_reduce(c)
    model.train()
    return {f"t2i_R@{k}": (100 * c[j] / c[-1]).item() for j, k in enumerate(ks)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = BertTokenizerFast.from_pretrained("bert-base-uncased")
    norm = T.Normalize([0.5] * 3, [0.5] * 3)
    tr = T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    te = T.Compose([T.Resize((224, 224)), T.ToTensor(), norm])
    train_ds = Pairs(args.train_json, args.image_root, tr)
    val_ds = Pairs(args.val_json, args.image_root, te)

    def collate(batch):
        x, caps, _ = zip(*batch)
        enc = tok(list(caps), padding="longest", truncation=True, max_length=40, return_tensors="pt")
        return torch.stack(x), enc.input_ids, enc.attention_mask

    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=collate, pin_memory=True, drop_last=True, persistent_workers=True)

    model = ITCITM(args.fusion_layers).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 512
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=0.02)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        use_itm = epoch >= args.itm_start_epoch
        t0, tot = time.time(), torch.zeros(3, device=device)
        for step, (x, ids, mask) in enumerate(loader):
            x, ids, mask = x.to(device, non_blocking=True), ids.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                l_itc, l_itm = ddp(x, ids, mask, use_itm)
            loss = l_itc + args.itm_weight * l_itm
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([l_itc.detach().float(), l_itm.detach().float(), torch.ones((), device=device)])
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step} itc {l_itc.item():.4f} itm {l_itm.item():.4f}", flush=True)
        dist.all_reduce(tot)
        res = evaluate(model, val_ds, tok, device, args.workers)
        if rank == 0:
            print(f"epoch {epoch} itc {(tot[0] / tot[2]).item():.4f} itm {(tot[1] / tot[2]).item():.4f} "
                  f"{time.time() - t0:.0f}s " + " ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
            if res["t2i_R@1"] > best:
                best = res["t2i_R@1"]
                torch.save({"model": model.state_dict(), "epoch": epoch, "metrics": res},
                           os.path.join(args.out, "best.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
