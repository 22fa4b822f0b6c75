fn main() {
    let n: usize = std::env::args().nth(1).unwrap().parse().unwrap();
    let dir = std::env::args().nth(2).unwrap();
    proxy_tests::bench::services::ServiceSet::new(n).write_manifests(std::path::Path::new(&dir), 1000).unwrap();
}
