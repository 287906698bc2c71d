#!/usr/bin/env python3
"""Writes a self-signed certificate and its key (PEM) for `localhost` and 127.0.0.1, for
Envoy's QUIC listener: DIR/cert.pem and DIR/key.pem. Uses `cryptography` (which aioquic
brings). Prints {"event":"certs","cert":PATH,"key":PATH}."""

import argparse
import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from events import emit


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dir", help="where to write cert.pem and key.pem")
    args = parser.parse_args()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path = os.path.join(args.dir, "cert.pem")
    key_path = os.path.join(args.dir, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    emit("certs", cert=cert_path, key=key_path)


if __name__ == "__main__":
    main()
