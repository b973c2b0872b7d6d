//! The JSON request body of the guest measurements, shared with the
//! guest crate's native canonicalizer bench (`guest/benches/canonical.rs`),
//! so that both measure the same documents.

/// A JSON order of about `size` bytes: line items with notes, in a key
/// order the canonical form has to sort.
pub fn json_body(size: usize) -> String {
    let mut body = String::from(r#"{"sku":"A1","customer":"c-42","items":["#);
    let mut i = 0;
    while body.len() + 80 < size {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&format!(
            r#"{{"qty":{},"sku":"S{i:05}","price":{}.5,"note":"line {i} of the order"}}"#,
            i % 7 + 1,
            i * 3
        ));
        i += 1;
    }
    body.push_str("]}");
    while body.len() < size {
        body.insert(1, ' ');
    }
    body
}
