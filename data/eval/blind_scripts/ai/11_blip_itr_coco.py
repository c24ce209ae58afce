'''
BLIP-style image-text retrieval fine-tuning on COCO (Karpathy split): ITC over the global batch + ITM with
hard negatives mined across GPUs, top-k ITM re-ranking at test time.
'''
import argparse
import datetime
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from transformers import BertModel, BertTokenizer


def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()


def get_rank():
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def get_world_size():
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def is_main_process():
    return get_rank() == 0


def init_distributed_mode(args):
    if 'RANK' in os.environ and 'WORLD_SIZE' in os.environ:
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ['WORLD_SIZE'])
        args.gpu = int(os.environ['LOCAL_RANK'])
    elif 'SLURM_PROCID' in os.environ:
        args.rank, args.world_size = int(os.environ['SLURM_PROCID']), int(os.environ['SLURM_NTASKS'])
        args.gpu = args.rank % torch.cuda.device_count()
    else:
        print('Not using distributed mode')
        args.distributed = False
        return
    args.distributed = True
    torch.cuda.set_device(args.gpu)
    print('| distributed init (rank {}, world {}): {}'.format(args.rank, args.world_size, args.dist_url), flush=True)
    dist.init_process_group(backend='nccl', init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    dist.barrier()


@torch.no_grad()
def concat_all_gather(tensor):
    """Performs all_gather operation on the provided tensors. *** Warning ***: torch.distributed.all_gather has no gradient."""
    tensors_gather = [torch.ones_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(tensors_gather, tensor, async_op=False)
    return torch.cat(tensors_gather, dim=0)


class GatherLayer(torch.autograd.Function):
    """Gather tensors from all workers with support for backward propagation."""

    @staticmethod
    def forward(ctx, x):
        output = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(output, x)
        return tuple(output)

    @staticmethod
    def backward(ctx, *grads):
        all_gradients = torch.stack(grads)
        dist.all_reduce(all_gradients)
        return all_gradients[dist.get_rank()]


def all_gather_with_grad(tensors):
    if get_world_size() == 1:
        return tensors
    return torch.cat(GatherLayer.apply(tensors), dim=0)


class CocoKarpathy(Dataset):
    def __init__(self, ann_file, image_root, transform, train=True, max_words=35):
        self.ann = json.load(open(ann_file))
        self.image_root, self.transform, self.train, self.max_words = image_root, transform, train, max_words
        self.text, self.txt2img, self.img2txt, self.img_ids = [], {}, {}, {}
        for img_id, ann in enumerate(self.ann):
            self.img2txt[img_id] = []
            for caption in (ann['caption'] if isinstance(ann['caption'], list) else [ann['caption']]):
                self.txt2img[len(self.text)] = img_id
                self.img2txt[img_id].append(len(self.text))
                self.text.append(' '.join(caption.lower().strip().split()[:max_words]))
        self.pairs = [(t, i) for t, i in self.txt2img.items()]

    def __len__(self):
        return len(self.pairs) if self.train else len(self.ann)

    def __getitem__(self, index):
        if self.train:
            t, img_id = self.pairs[index]
            image = Image.open(os.path.join(self.image_root, self.ann[img_id]['image'])).convert('RGB')
            return self.transform(image), self.text[t], img_id
        image = Image.open(os.path.join(self.image_root, self.ann[index]['image'])).convert('RGB')
        return self.transform(image), index


class BLIPRetrieval(nn.Module):
    def __init__(self, vit='vit_base_patch16_384', text_encoder='bert-base-uncased', embed_dim=256):
        super().__init__()
        self.visual_encoder = timm.create_model(vit, pretrained=True, num_classes=0)
        self.tokenizer = BertTokenizer.from_pretrained(text_encoder)
        self.text_encoder = BertModel.from_pretrained(text_encoder, add_pooling_layer=False)
        width, text_width = self.visual_encoder.num_features, self.text_encoder.config.hidden_size
        self.vision_proj = nn.Linear(width, embed_dim)
        self.text_proj = nn.Linear(text_width, embed_dim)
        self.image_to_text = nn.Linear(width, text_width)
        self.fusion = nn.TransformerDecoder(nn.TransformerDecoderLayer(text_width, 12, 4 * text_width, batch_first=True), 2)
        self.itm_head = nn.Linear(text_width, 2)
        self.temp = nn.Parameter(0.07 * torch.ones([]))

    def tokenize(self, caption, device):
        return self.tokenizer(caption, padding='max_length', truncation=True, max_length=35, return_tensors="pt").to(device)

    def fuse(self, text_hidden, text_mask, image_embeds):
        out = self.fusion(text_hidden, self.image_to_text(image_embeds), tgt_key_padding_mask=~text_mask.bool())
        return self.itm_head(out[:, 0, :])

    def forward(self, image, caption, idx):
        with torch.no_grad():
            self.temp.clamp_(0.001, 0.5)
        image_embeds = self.visual_encoder.forward_features(image)
        image_feat = F.normalize(self.vision_proj(image_embeds[:, 0, :]), dim=-1)
        text = self.tokenize(caption, image.device)
        text_hidden = self.text_encoder(text.input_ids, attention_mask=text.attention_mask, return_dict=True).last_hidden_state
        text_feat = F.normalize(self.text_proj(text_hidden[:, 0, :]), dim=-1)

        # ITC over the global batch
        idx = idx.view(-1, 1)
        idx_all = concat_all_gather(idx) if get_world_size() > 1 else idx
        pos_idx = torch.eq(idx, idx_all.t()).float()
        sim_targets = pos_idx / pos_idx.sum(1, keepdim=True)
        image_feat_world = all_gather_with_grad(image_feat)
        text_feat_world = all_gather_with_grad(text_feat)
        sim_i2t = image_feat @ text_feat_world.t() / self.temp
        sim_t2i = text_feat @ image_feat_world.t() / self.temp
        loss_ita = (-torch.sum(F.log_softmax(sim_i2t, dim=1) * sim_targets, dim=1).mean()
                    - torch.sum(F.log_softmax(sim_t2i, dim=1) * sim_targets, dim=1).mean()) / 2

        # ITM with hard negatives sampled from the whole world batch
        bs = image.size(0)
        text_ids_world = concat_all_gather(text.input_ids) if get_world_size() > 1 else text.input_ids
        text_mask_world = concat_all_gather(text.attention_mask) if get_world_size() > 1 else text.attention_mask
        image_embeds_world = all_gather_with_grad(image_embeds)
        with torch.no_grad():
            mask = torch.eq(idx, idx_all.t())
            weights_t2i = F.softmax(sim_t2i, dim=1).masked_fill(mask, 0) + 1e-5
            weights_i2t = F.softmax(sim_i2t, dim=1).masked_fill(mask, 0) + 1e-5
        image_embeds_neg = image_embeds_world[torch.multinomial(weights_t2i, 1).squeeze(1)]
        neg_txt = torch.multinomial(weights_i2t, 1).squeeze(1)
        text_hidden_neg = self.text_encoder(text_ids_world[neg_txt], attention_mask=text_mask_world[neg_txt],
                                            return_dict=True).last_hidden_state
        logits_pos = self.fuse(text_hidden, text.attention_mask, image_embeds)
        logits_neg = torch.cat([self.fuse(text_hidden, text.attention_mask, image_embeds_neg),
                                self.fuse(text_hidden_neg, text_mask_world[neg_txt], image_embeds)], dim=0)
        itm_labels = torch.cat([torch.ones(bs, dtype=torch.long), torch.zeros(2 * bs, dtype=torch.long)]).to(image.device)
        loss_itm = F.cross_entropy(torch.cat([logits_pos, logits_neg], dim=0), itm_labels)
        return loss_ita, loss_itm


@torch.no_grad()
def evaluation(model, data_loader, device, k_test=128):
    model.eval()
    dataset = data_loader.dataset
    text_hidden, text_masks, text_feats = [], [], []
    for i in range(0, len(dataset.text), 256):
        text = model.tokenize(dataset.text[i:i + 256], device)
        h = model.text_encoder(text.input_ids, attention_mask=text.attention_mask, return_dict=True).last_hidden_state
        text_hidden.append(h)
        text_masks.append(text.attention_mask)
        text_feats.append(F.normalize(model.text_proj(h[:, 0, :]), dim=-1))
    text_hidden, text_masks, text_feats = torch.cat(text_hidden), torch.cat(text_masks), torch.cat(text_feats)
    image_embeds, image_feats = [], []
    for image, _ in data_loader:
        e = model.visual_encoder.forward_features(image.to(device))
        image_embeds.append(e)
        image_feats.append(F.normalize(model.vision_proj(e[:, 0, :]), dim=-1))
    image_embeds, image_feats = torch.cat(image_embeds), torch.cat(image_feats)

    sims_matrix = image_feats @ text_feats.t()
    score_matrix_i2t = torch.full((len(dataset.ann), len(dataset.text)), -100.0).to(device)
    # every rank re-ranks its own block of rows; the blocks are combined with one all_reduce below
    step = sims_matrix.size(0) // get_world_size() + 1
    start, end = get_rank() * step, min(sims_matrix.size(0), (get_rank() + 1) * step)
    for i, sims in enumerate(sims_matrix[start:end]):
        topk_sim, topk_idx = sims.topk(k=k_test, dim=0)
        enc = image_embeds[start + i].repeat(k_test, 1, 1)
        score = model.fuse(text_hidden[topk_idx], text_masks[topk_idx], enc)[:, 1]
        score_matrix_i2t[start + i, topk_idx] = score + topk_sim
    if get_world_size() > 1:
        dist.barrier()
        dist.all_reduce(score_matrix_i2t, op=dist.ReduceOp.SUM)
    return score_matrix_i2t.cpu().numpy()


@torch.no_grad()
def itm_eval(scores_i2t, img2txt, txt2img):
    ranks = np.zeros(scores_i2t.shape[0])
    for index, score in enumerate(scores_i2t):
        inds = np.argsort(score)[::-1]
        ranks[index] = min(np.where(inds == i)[0][0] for i in img2txt[index])
    tr1, tr5, tr10 = (100.0 * np.mean(ranks < k) for k in (1, 5, 10))
    return {'txt_r1': tr1, 'txt_r5': tr5, 'txt_r10': tr10, 'txt_r_mean': (tr1 + tr5 + tr10) / 3}


def main(args):
    init_distributed_mode(args)
    device = torch.device('cuda')
    seed = args.seed + get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    normalize = transforms.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
    train_tf = transforms.Compose([transforms.RandomResizedCrop(args.image_size, scale=(0.5, 1.0), interpolation=3),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize])
    test_tf = transforms.Compose([transforms.Resize((args.image_size, args.image_size), interpolation=3),
                                  transforms.ToTensor(), normalize])
    train_set = CocoKarpathy(os.path.join(args.ann_root, 'coco_karpathy_train.json'), args.image_root, train_tf, train=True)
    test_set = CocoKarpathy(os.path.join(args.ann_root, 'coco_karpathy_test.json'), args.image_root, test_tf, train=False)
    sampler = torch.utils.data.DistributedSampler(train_set, shuffle=True) if args.distributed else None
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=64, shuffle=False, num_workers=4)

    model = BLIPRetrieval(vit='vit_base_patch16_384').to(device)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.init_lr, weight_decay=args.weight_decay)

    best, best_epoch = 0, 0
    for epoch in range(args.max_epoch):
        if args.distributed:
            train_loader.sampler.set_epoch(epoch)
        lr = (args.init_lr - args.min_lr) * 0.5 * (1. + np.cos(np.pi * epoch / args.max_epoch)) + args.min_lr
        for g in optimizer.param_groups:
            g['lr'] = lr
        model.train()
        start = time.time()
        for i, (image, caption, idx) in enumerate(train_loader):
            image, idx = image.to(device, non_blocking=True), idx.to(device, non_blocking=True)
            loss_ita, loss_itm = model(image, caption, idx)
            loss = loss_ita + loss_itm
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if i % 50 == 0:
                print('Epoch [{}] [{}/{}] loss_ita {:.4f} loss_itm {:.4f} lr {:.2e} ({:.0f}s)'.format(
                    epoch, i, len(train_loader), loss_ita.item(), loss_itm.item(), lr, time.time() - start))

        score_i2t = evaluation(model_without_ddp, test_loader, device, k_test=args.k_test)
        if is_main_process():
            result = itm_eval(score_i2t, test_set.img2txt, test_set.txt2img)
            print(result)
            if result['txt_r_mean'] > best:
                best, best_epoch = result['txt_r_mean'], epoch
                torch.save({'model': model_without_ddp.state_dict(), 'optimizer': optimizer.state_dict(),
                            'epoch': epoch}, os.path.join(args.output_dir, 'checkpoint_best.pth'))
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps({'epoch': epoch, **{f'test_{k}': v for k, v in result.items()}}) + "\n")
        if args.distributed:
            dist.barrier()

    if is_main_process():
        print("best epoch: %d, txt_r_mean %.2f" % (best_epoch, best))
    if args.distributed:
        dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--image_root', default='/export/share/datasets/vision/coco/images/')
    parser.add_argument('--ann_root', default='annotation')
    parser.add_argument('--output_dir', default='output/Retrieval_coco')
    parser.add_argument('--image_size', default=384, type=int)
    parser.add_argument('--batch_size', default=32, type=int)
    parser.add_argument('--init_lr', default=1e-5, type=float)
    parser.add_argument('--min_lr', default=0., type=float)
    parser.add_argument('--weight_decay', default=0.05, type=float)
    parser.add_argument('--max_epoch', default=6, type=int)
    parser.add_argument('--k_test', default=256, type=int)
    parser.add_argument('--seed', default=42, type=int)
    parser.add_argument('--dist_url', default='env://')
    args = parser.parse_args()
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    start_time = time.time()
    main(args)
    print('Training time {}'.format(str(datetime.timedelta(seconds=int(time.time() - start_time)))))
