"""ImageFolder sources (trjax.data.imagefolder, datasets.load_image_folder) on what real folders hold."""
import io
import os
import re

import numpy as np
import pytest
from PIL import Image

from trjax.data import datasets as ds
from trjax.data import imagefolder as imf


def gradient_image(w, h):
    """Brightness increasing left to right (so a flip is visible)."""
    row = np.linspace(0, 255, w).astype(np.uint8)
    return Image.fromarray(np.repeat(np.repeat(row[None, :, None], h, 0), 3, 2))


def write_folder(root, classes=("dog", "cat")):
    """root/{train,val}/{dog,cat}/ with PNG and JPEG files of different sizes, plus clutter."""
    for split in ("train", "val"):
        for c, cls in enumerate(classes):
            d = root / split / cls
            d.mkdir(parents=True)
            gradient_image(64, 48).save(d / "a.png")
            Image.new("RGB", (30, 40), (255, 0, 128)).save(d / "b.png")
            Image.fromarray(np.random.default_rng(c).integers(0, 256, (20, 36, 3), dtype=np.uint8)) \
                .save(d / "c.JPEG", quality=90)
            (d / "notes.txt").write_text("not an image")
            # what macOS, Windows and Finder leave behind
            (d / "._a.png").write_bytes(b"\x00\x05\x16\x07AppleDouble metadata")
            (d / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
            (d / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
            (d / "desktop.ini").write_text("[.ShellClassInfo]")
        (root / split / ".hidden_class").mkdir()
        (root / split / ".hidden_class" / "x.png").write_bytes(b"")


def esc(path):
    return re.escape(str(path))


def test_lists_images_only_sorted_classes_and_labels(tmp_path):
    write_folder(tmp_path)
    train = imf.ImageFolder(tmp_path, "train")
    assert train.classes == ["cat", "dog"] and train.num_classes == 2  # sorted, hidden skipped
    assert [os.path.basename(p) for p in train.paths] == ["a.png", "b.png", "c.JPEG"] * 2
    assert train.labels.dtype == np.int32 and train.labels.tolist() == [0, 0, 0, 1, 1, 1]
    d = ds.load_dataset("imagefolder", str(tmp_path), image_size=16)
    assert d.image_shape == (16, 16, 3) and d.image_dtype == np.uint8 and d.num_classes == 2
    np.testing.assert_allclose(d.mean, (123.675, 116.28, 103.53))
    np.testing.assert_allclose(d.std, (58.395, 57.12, 57.375))
    for i in range(len(train)):  # every listed file decodes
        assert train.image(i).mode == "RGB"
    assert [imf.is_image_name(n) for n in ("x.jpg", "X.PNG", "._x.jpg", ".DS_Store",
                                           "Thumbs.db", "desktop.ini", "a.txt", "b.webp")] == \
        [True, True, False, False, False, False, False, True]


def _png_bytes(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_every_mode_becomes_rgb_on_the_8_bit_scale(tmp_path):
    rng = np.random.default_rng(0)
    g8 = rng.integers(0, 256, (12, 10), dtype=np.uint8)
    # a 16-bit grayscale PNG and its 8-bit copy: the same picture
    p16 = tmp_path / "g16.png"
    Image.fromarray(g8.astype(np.uint16) * 257 + rng.integers(0, 200, g8.shape).astype(np.uint16)) \
        .save(p16)
    with Image.open(p16) as im:
        assert im.mode.startswith("I")  # Pillow opens it as I;16 or I, not 8-bit
    out = np.asarray(imf.decode(str(p16)), np.int64)
    assert out.shape == (12, 10, 3) and (out[..., 0] == out[..., 2]).all()
    assert np.abs(out[..., 0] - g8).max() <= 1  # within 1/255 of the 8-bit copy
    # 32-bit integer I holding 16-bit data, float F on [0, 1]
    i32 = Image.fromarray(g8.astype(np.int32) * 257, "I")
    np.testing.assert_array_equal(np.asarray(imf.to_rgb(i32))[..., 1], g8)
    f = Image.fromarray(g8.astype(np.float32) / 255.0, "F")
    np.testing.assert_array_equal(np.asarray(imf.to_rgb(f))[..., 0], g8)
    f_out = Image.fromarray(np.array([[-1.0, 2.0]], np.float32), "F")
    np.testing.assert_array_equal(np.asarray(imf.to_rgb(f_out))[0, :, 0], [0, 255])  # clipped
    # palette (with transparency), grayscale +- alpha, RGBA, CMYK, 1-bit: Pillow's own maps
    rgb = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
    rgba = Image.fromarray(np.concatenate([rgb, np.full((6, 5, 1), 7, np.uint8)], -1), "RGBA")
    np.testing.assert_array_equal(np.asarray(imf.to_rgb(rgba)), rgb)  # alpha dropped
    la = Image.fromarray(np.stack([g8, g8 // 2], -1), "LA")
    np.testing.assert_array_equal(np.asarray(imf.to_rgb(la)), np.repeat(g8[..., None], 3, -1))
    cmyk = Image.new("CMYK", (3, 2), (0, 255, 255, 0))  # no cyan, full magenta and yellow: red
    np.testing.assert_array_equal(np.asarray(imf.to_rgb(cmyk))[0, 0], [255, 0, 0])
    one = Image.fromarray(np.array([[0, 1]], bool))
    assert one.mode == "1"
    np.testing.assert_array_equal(np.asarray(imf.to_rgb(one))[0], [[0, 0, 0], [255, 255, 255]])
    pal = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
    pal.info["transparency"] = 0
    pp = tmp_path / "p.png"
    pal.save(pp)
    expected = np.asarray(Image.open(pp).convert("RGBA"))[..., :3]
    np.testing.assert_array_equal(np.asarray(imf.decode(str(pp))), expected)


def test_exif_orientation_is_applied(tmp_path):
    img = gradient_image(40, 20)  # wide, brighter to the right
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    path = tmp_path / "rot.jpg"
    img.save(path, quality=95, exif=exif)
    out = np.asarray(imf.decode(str(path)), np.float64)
    assert out.shape == (40, 20, 3)  # tall once oriented
    column = out.mean(axis=(1, 2))
    assert column[-1] - column[0] > 150  # the bright right edge is now at the bottom


def _write_bad_folder(root):
    write_folder(root)
    good = (root / "train" / "cat" / "c.JPEG").read_bytes()
    (root / "train" / "cat" / "d_truncated.jpg").write_bytes(good[:len(good) // 2])
    (root / "train" / "dog" / "e_text.png").write_text("this is not a png")
    return [str(root / "train" / "cat" / "d_truncated.jpg"), str(root / "train" / "dog" / "e_text.png")]


def test_truncated_and_corrupt_files_named_by_verify_or_skipped(tmp_path):
    bad = _write_bad_folder(tmp_path)
    folder = imf.ImageFolder(tmp_path, "train")
    assert len(folder) == 8  # listed (by name); decoding is lazy
    with pytest.raises(imf.BadImage, match=esc(bad[0]) + ": cannot decode image"):
        folder.image(folder.paths.index(bad[0]))
    assert [p for p, _ in folder.find_bad(workers=2)] == bad
    with pytest.raises(ValueError, match=r"(?s)2 file\(s\) in .* cannot be decoded:\n  " + esc(bad[0])
                       + ".*\n  " + esc(bad[1]) + ".*skip_bad_images=True"):
        ds.load_dataset("imagefolder", str(tmp_path), 16, verify=True)
    d = ds.load_dataset("imagefolder", str(tmp_path), 16, verify=True, skip_bad_images=True)
    assert len(d.train) == 6 and d.train.skipped == tuple(bad) and d.val.skipped == ()
    assert d.train.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert not set(bad) & set(d.train.paths)


def test_empty_class_and_class_mismatch_name_the_folders(tmp_path):
    write_folder(tmp_path)
    (tmp_path / "val" / "cat").rename(tmp_path / "val" / "kitten")
    with pytest.raises(ValueError, match=esc(tmp_path / "train") + " and " + esc(tmp_path / "val")
                       + r" hold different class folders: only in train \['cat'\], only in val "
                       r"\['kitten'\]"):
        ds.load_dataset("imagefolder", str(tmp_path), 16)
    (tmp_path / "train" / "empty").mkdir()
    (tmp_path / "train" / "empty" / "._ghost.jpg").write_bytes(b"metadata")
    with pytest.raises(ValueError, match=r"class directories without images .*"
                       + esc(tmp_path / "train" / "empty")):
        imf.ImageFolder(tmp_path, "train")


def test_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=esc(tmp_path / "nowhere") + r".*root/\{train,val\}"):
        imf.ImageFolder(tmp_path / "nowhere", "train")
    (tmp_path / "train").mkdir()
    with pytest.raises(FileNotFoundError, match=esc(tmp_path / "val") + " does not exist"):
        imf.ImageFolder(tmp_path, "val")
    with pytest.raises(ValueError, match=esc(tmp_path / "train") + " has no class directories"):
        imf.ImageFolder(tmp_path, "train")
    (tmp_path / "train" / "cat").mkdir()
    (tmp_path / "train" / "cat" / "readme.txt").write_text("x")
    with pytest.raises(ValueError, match=esc(tmp_path / "train") + " holds no images"):
        imf.ImageFolder(tmp_path, "train")
    (tmp_path / "train" / "dog").mkdir()
    (tmp_path / "train" / "dog" / "x.png").write_bytes(b"not a png")
    (tmp_path / "train" / "cat" / "y.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match=r"class directories \['cat'\] are not among"):
        imf.ImageFolder(tmp_path, "train", classes=["dog"])
    with pytest.raises(IndexError, match="index 2 is outside"):
        imf.ImageFolder(tmp_path, "train").image(2)


# ---------------------------------------------------------------------------
# Names as text: NFC and NFD folders give one label mapping (macOS file systems
# may hand out NFD names; Linux keeps the bytes as given, so both forms exist here).
# ---------------------------------------------------------------------------

NFD_E, NFC_E = "e\u0301", "\u00e9"  # "é" decomposed / composed


def _named_folder(root, split, e):
    """root/split/{dog, <e>clair, fox}/{a, <e>t<e>, f}.png with ``e`` one form of "é".

    NFD sorts "<e>clair" before "fox" ("e" < "f"), NFC after it ("é" > "f")."""
    for cls in ("dog", f"{e}clair", "fox"):
        (root / split / cls).mkdir(parents=True)
        for stem in ("a", f"{e}t{e}", "f"):
            gradient_image(8, 6).save(root / split / cls / f"{stem}.png")


def test_label_indices_depend_on_the_class_names_as_text_not_their_unicode_form(tmp_path):
    import unicodedata
    from trjax.data import input_pipeline as ip
    folders = {}
    for name, train_e, val_e in (("nfd", NFD_E, NFD_E), ("nfc", NFC_E, NFC_E),
                                 ("mixed", NFD_E, NFC_E)):  # a Mac's train, a Linux val
        _named_folder(tmp_path / name, "train", train_e)
        _named_folder(tmp_path / name, "val", val_e)
        folders[name] = ds.load_dataset("imagefolder", str(tmp_path / name), image_size=8)
    # the folders really differ on disk: sorted as stored, NFD puts "éclair" second
    assert sorted(os.listdir(tmp_path / "nfd" / "train"))[1] == f"{NFD_E}clair"
    assert sorted(os.listdir(tmp_path / "nfc" / "train"))[2] == f"{NFC_E}clair"
    for d in folders.values():
        for split in (d.train, d.val):
            assert split.classes == ["dog", "fox", "\u00e9clair"]  # NFC, code point order
            assert split.labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
            # file order within a class (example index, epoch order, val batches): by text too
            names = [unicodedata.normalize("NFC", os.path.basename(p)) for p in split.paths]
            assert names == ["a.png", "f.png", "\u00e9t\u00e9.png"] * 3
            assert all(os.path.isfile(p) for p in split.paths)  # the names on disk
            assert split.image(8).size == (8, 6)
    assert os.path.basename(folders["nfd"].train.paths[8]) == f"{NFD_E}t{NFD_E}.png"
    assert ip.skipped_images(folders["nfd"], {f"/x/{NFD_E}", "/x/f", "/x/a"}) == \
        ["/x/a", "/x/f", f"/x/{NFD_E}"]  # reported in the same text order
    # another split's classes given in the other form: the same indices
    val = imf.ImageFolder(tmp_path / "nfc", "val", classes=["dog", "fox", f"{NFD_E}clair"])
    assert val.classes == ["dog", "fox", "\u00e9clair"] and val.labels.tolist()[-1] == 2
    with pytest.raises(ValueError, match=r"classes \['\u00e9clair'\] are given more than once"):
        imf.ImageFolder(tmp_path / "nfc", "val", classes=[f"{NFD_E}clair", f"{NFC_E}clair"])
    assert imf.text_key(f"{NFD_E}clair") == "\u00e9clair"


def test_two_names_that_are_one_text_in_two_forms_are_an_error_naming_both(tmp_path):
    train = tmp_path / "train"
    for e in (NFD_E, NFC_E):
        (train / f"caf{e}").mkdir(parents=True)
        gradient_image(8, 6).save(train / f"caf{e}" / "a.png")
    nfd, nfc = train / "cafe\u0301", train / "caf\u00e9"
    with pytest.raises(ValueError, match=esc(f"class folders {nfd} and {nfc} are the same name "
                                             "'caf\u00e9' in two Unicode forms (NFD 'cafe\\u0301', "
                                             "NFC 'caf\\xe9')") + ".*rename one"):
        imf.ImageFolder(tmp_path, "train")
    nfc.rename(train / "tea")
    gradient_image(8, 6).save(nfd / f"{NFC_E}.png")
    gradient_image(8, 6).save(nfd / f"{NFD_E}.png")
    with pytest.raises(ValueError, match=esc(f"files {nfd / (NFD_E + '.png')} and "
                                             f"{nfd / (NFC_E + '.png')} are the same name")):
        imf.ImageFolder(tmp_path, "train")
